"""Policy shared by the pipeline's tasks."""

import logging

from prefect.cache_policies import DEFAULT


def _retry_unless_bad_input(task, task_run, state) -> bool:
    """A bad input (a ``ValueError``, which names the key and the fix) fails the same way every
    time: it is not retried."""
    return not isinstance(state.data, ValueError)


# DEFAULT = task inputs + task source + flow run id: a retried flow run reuses finished steps,
# a new run with the same parameters computes them anew (INPUTS alone would skip training).
STEP_POLICY = dict(
    persist_result=True,
    cache_policy=DEFAULT,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=_retry_unless_bad_input,
)


class _BadInputWithoutTraceback(logging.Filter):
    """A refused input is reported by its message, which names the key and the fix; the
    traceback Prefect attaches to a failed run's log record would bury it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ValueError):
            record.exc_info = None
            record.exc_text = None
        return True


for _name in ("prefect.task_runs", "prefect.flow_runs"):
    logging.getLogger(_name).addFilter(_BadInputWithoutTraceback())
