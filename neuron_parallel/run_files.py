"""The names of what a run directory holds (``JobConfig.output_dir``), defined once.

Nothing here imports anything: the launcher, the ranks, the reporters and the pipeline's steps
all name the same files through these constants. The ``checkpoint-<step>`` folders and the files
inside them are named by ``neuron_parallel.checkpoint`` (``list_checkpoints`` finds them).
"""

JOB_FILE = "job.json"
"""The ``JobConfig`` the launcher writes for the ranks (``python -m neuron_parallel.train RUN_DIR/job.json``)."""
METRICS_FILE = "metrics.jsonl"
"""One JSON record per optimizer step, written by rank 0 (``reporting.read_metrics`` reads it back)."""
MEMORY_FILE = "memory.json"
"""Every rank's measured peak tensor memory beside the planner's prediction (``train.profile_memory``)."""
LOSS_CURVE_FILE = "loss_curve.png"
"""The loss curve the report step draws into the run directory, and the upload step beside the model card."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard's event files (``train.report_to: [tensorboard]``)."""
MLFLOW_DB = "mlflow.db"
"""MLflow's SQLite store when ``MLFLOW_TRACKING_URI`` is unset (``train.report_to: [mlflow]``)."""
MLFLOW_RUN_FILE = "mlflow_run.json"
"""The tracking URI and id of the run's MLflow run, so a resumed run continues it."""
MLFLOW_ARTIFACTS_DIR = "mlartifacts"
"""The artifact root of an MLflow experiment the run creates in its own SQLite store."""
EVALUATION_FILE = "evaluation.json"
"""The evaluate step's figures of the model and its baseline, and whether the model is published."""
GENERATIONS_FILE = "generations.jsonl"
"""The evaluated model's greedy generation for each row of ``evaluate.prompts``."""
BASELINE_GENERATIONS_FILE = "generations_baseline.jsonl"
"""The same prompts' generations of the baseline, when it generated (the base model)."""
