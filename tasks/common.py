"""Policy shared by the pipeline's tasks."""

from prefect.cache_policies import DEFAULT

# DEFAULT = task inputs + task source + flow run id: a retried flow run reuses finished steps,
# a new run with the same parameters computes them anew (INPUTS alone would skip training).
STEP_POLICY = dict(persist_result=True, cache_policy=DEFAULT, retries=1, retry_delay_seconds=5)
