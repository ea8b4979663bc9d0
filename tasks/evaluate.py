"""The evaluate step as a Prefect task (``tasks.steps.evaluate``): the figures and the generations
as table artifacts. It runs in the flow's transaction between consolidate and upload, so, like the
upload, it makes one attempt (a failed attempt rolls the staged model back: ``tasks.upload``)."""

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from neuron_parallel.data import TokenizedDataset
from neuron_parallel.promotion import Evaluation, prompt_text

from . import steps
from .common import hub_token
from .config import FinetuneConfig
from .upload import UPLOAD_POLICY


@task(name="evaluate", **UPLOAD_POLICY)
def evaluate(config: FinetuneConfig, model_dir: str, dataset: TokenizedDataset) -> Evaluation:
    """Evaluate the model consolidate staged for ``model_dir`` and decide whether it is published."""
    gate = config.library("evaluate").gate
    token = hub_token(config) if gate is not None and gate.baseline == "hub" else None
    evaluation = steps.evaluate(
        config, model_dir, eval_path=dataset.eval_path, staged=True, token=token, log=get_run_logger().info
    )
    if evaluation.model:
        figures = [
            {"figure": key, "model": value, "baseline": evaluation.baseline.get(key)}
            for key, value in evaluation.model.items()
        ]
        verdict = "promoted" if evaluation.promoted else "not promoted"
        create_table_artifact(key="evaluation", table=figures, description=f"{verdict}: {evaluation.reason}")
    if evaluation.generations:
        baseline = evaluation.baseline_generations
        rows = [
            {"prompt": prompt_text(g["prompt"]), "completion": g["completion"]}
            | ({"baseline": baseline[n]["completion"]} if baseline else {})
            for n, g in enumerate(evaluation.generations)
        ]
        create_table_artifact(key="generations", table=rows, description="Greedy generations of evaluate.prompts")
    return evaluation
