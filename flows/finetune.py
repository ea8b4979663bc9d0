"""The fine-tuning pipeline: tokenize → plan → train → validate → consolidate → upload."""

from __future__ import annotations

from prefect import flow

from tasks.config import FinetuneConfig
from tasks.consolidate import consolidate
from tasks.plan import plan
from tasks.tokenize import tokenize
from tasks.train import train
from tasks.upload import upload
from tasks.validate import validate


@flow(name="finetune", log_prints=True)
def finetune(config: FinetuneConfig = FinetuneConfig()) -> dict:
    """Fine-tune ``config.model`` on ``config.data`` and publish the consolidated model."""
    dataset = tokenize(config)
    layout = plan(config, dataset)
    result = train(config, dataset, layout)
    checkpoint = validate(result)
    model_dir = consolidate(config, checkpoint)
    commit = upload(config, model_dir, result, layout)
    return {
        "run_dir": result.run_dir,
        "checkpoint": checkpoint,
        "consolidated": model_dir,
        "final_step": result.final_step,
        "hub_url": commit.url if commit else None,
    }
