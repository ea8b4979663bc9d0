"""Refuse, before any data is read, a run that the machine, the model's or the data's files or
the Hub already show cannot work."""

from prefect import task

from .common import remember_failed_step
from .config import FinetuneConfig
from .config import preflight as check_run
from .upload import hub_token


@task(name="preflight", retries=0, on_failure=[remember_failed_step])
def preflight(config: FinetuneConfig) -> None:
    check_run(config, hub_token=hub_token(config), check_upload=True)
