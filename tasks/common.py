"""Policy shared by the pipeline's tasks, and the Hub token as the flow finds it."""

import logging
import os

from prefect.cache_policies import DEFAULT

from .config import ALLOWED_HUB_ENDPOINTS_ENV


def hub_token(config) -> str | None:
    """The Hub token from the Prefect Secret block ``hub.token_secret`` names, else HF_TOKEN. Never
    a flow parameter, never logged. Refused while the run's own job variables set where the token
    may go (:func:`check_token_destinations`)."""
    check_token_destinations()
    if config.hub.token_secret:
        from prefect.blocks.system import Secret

        return Secret.load(config.hub.token_secret).get()
    return os.environ.get("HF_TOKEN")


TOKEN_DESTINATION_ENV = (ALLOWED_HUB_ENDPOINTS_ENV, "HF_ENDPOINT")
"""The environment that decides where the Hub token may be sent (``tasks.config``): the worker's
and the deployment's to set, never a single run's."""


def check_token_destinations() -> None:
    """Refuse (``ValueError``) a flow run whose own job variables put :data:`TOKEN_DESTINATION_ENV`
    into its environment: whoever starts a run may set job variables, and the worker passes their
    ``env`` to the run's process, where ``hub.endpoint`` is checked against it."""
    from prefect.runtime import flow_run

    env = (flow_run.get_job_variables() or {}).get("env") or {}
    named = sorted(set(env) & set(TOKEN_DESTINATION_ENV))
    if named:
        raise ValueError(
            f"this run's job variables set {' and '.join(named)}: where the Hub token may go is decided by the "
            "operator, in the environment of the worker (or the deployment's job variables); start the run "
            "without them"
        )


def _retry_unless_bad_input(task, task_run, state) -> bool:
    """A bad input (a ``ValueError``, which names the key and the fix) fails the same way every
    time: it is not retried."""
    return not isinstance(state.data, ValueError)


_FAILED_STEP: dict[str, str] = {}


def remember_failed_step(task, task_run, state) -> None:
    """An ``on_failure`` hook: note, in this process, which step of the flow run failed for good
    (after its retries). The flow's failure report reads it with :func:`failed_step`; the server's
    copy of the task run's state is written from events and may not have arrived yet."""
    _FAILED_STEP[str(task_run.flow_run_id)] = task.name


def failed_step(flow_run_id: str) -> str | None:
    """The step of ``flow_run_id`` that failed last in this process, if any."""
    return _FAILED_STEP.pop(str(flow_run_id), None)


# DEFAULT = task inputs + task source + flow run id: a retried flow run reuses finished steps,
# a new run with the same parameters computes them anew (INPUTS alone would skip training).
STEP_POLICY = dict(
    persist_result=True,
    cache_policy=DEFAULT,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=_retry_unless_bad_input,
    on_failure=[remember_failed_step],
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
