"""The one user-facing configuration: YAML files, ``--set`` overrides and the Prefect UI form
are all ``FinetuneConfig``.

Its sections are built field by field from the library's dataclasses (``neuron_parallel.config``;
``evaluate`` from ``neuron_parallel.evaluate``), so each field, its default and its docstring are
written once. This module adds only what belongs to the boundary: ``auto`` for the fields the
planner chooses (``PLANNED_FIELDS``), the output paths, the Hub, and the launch's retries and
hardware kind. ``FinetuneConfig.to_job`` is the one place it becomes the library's ``JobConfig``.

Schema and loading only, with the checks that need nothing but the config itself: the layout is
chosen by the plan step and the machine, the files and the Hub are checked by the preflight step
(``tasks.steps``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
    with_config,
)

from neuron_parallel.config import (
    PLANNED_FIELDS,
    DataConfig,
    JobConfig,
    LaunchConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    check_eval,
    check_objective,
)
from neuron_parallel.evaluate import EvaluateConfig, GateConfig, check_gate
from neuron_parallel.planning.layout import CheckedLayout
from neuron_parallel.planning.resolve import DEVICE_HARDWARE, ResolvedLayout, check_pinned, pinned_layout
from neuron_parallel.urls import PUBLIC_HUB, base_url, encrypted_or_local, redact_url

AUTO = "auto"
DERIVED = {
    "parallel.dp": "dp is the world size / (cp × tp × pp)",
    "train.grad_accum": "gradient accumulation is global_batch_size / (micro_batch_size × dp); set "
    "train.global_batch_size and, if you want, train.micro_batch_size",
}
"""Keys that are not set but follow from others, with the rule."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _section(kind: type, section: str, **extra: Any) -> type[BaseModel]:
    """A pydantic model with the fields of the library dataclass ``kind`` (type, default and
    docstring as description), ``auto`` allowed and the default for its planned fields, plus
    ``extra`` boundary fields given as ``(type, Field(...))``."""
    # pydantic reads the attribute docstrings itself (use_attribute_docstrings); with_config only
    # records that option on the dataclass (``__pydantic_config__``), which nothing else reads.
    with_config(ConfigDict(use_attribute_docstrings=True))(kind)
    docs = TypeAdapter(kind).json_schema()["properties"]
    hints = typing.get_type_hints(kind)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(kind):
        if f"{section}.{f.name}" in DERIVED:
            continue
        kind_, default = hints[f.name], f.default
        if default is dataclasses.MISSING:
            default = f.default_factory()
        if f.name in PLANNED_FIELDS.get(section, ()):
            kind_, default = kind_ | Literal["auto"], AUTO
        fields[f.name] = (kind_, Field(default, description=docs[f.name].get("description")))
    return create_model(
        kind.__name__.replace("Config", "Section"), __base__=_Section, __doc__=kind.__doc__, **fields, **extra
    )


ModelSection = _section(ModelConfig, "model")
DataSection = _section(DataConfig, "data")
ParallelSection = _section(ParallelConfig, "parallel")
TrainSection = _section(TrainConfig, "train")
LaunchSection = _section(
    LaunchConfig,
    "launch",
    retries=(
        int,
        Field(
            1,
            ge=0,
            description="Automatic retries of the train step within a run; each resumes from the "
            "newest complete checkpoint.",
        ),
    ),
    hardware=(
        str | None,
        Field(
            None,
            description="Hardware kind the planner plans for (neuron_parallel.planning.hardware catalog "
            "or a YAML file); default from device: cpu → cpu, cuda → p5.48xlarge, neuron → trn2.48xlarge.",
        ),
    ),
)


class OutputSection(_Section):
    """Where the run's files go."""

    dir: str = Field(
        ".runs/{flow_run_name}",
        description="Run directory: metrics, checkpoints, consolidated model. {flow_run_name} and {flow_run_id} "
        "become the Prefect flow run's, so every run has its own directory and a retry of a run continues in it. "
        "A new or empty directory (or one neuron-flows created): a folder holding other files is refused.",
    )
    consolidated_dir: str | None = Field(
        None,
        description="Default: <output.dir>/consolidated. A new or empty directory (or an earlier neuron-flows "
        "output): a folder holding other files is refused, never overwritten.",
    )
    format: Literal["safetensors", "pytorch"] = "safetensors"
    max_shard_size: str = "5GB"

    @field_validator("dir")
    @classmethod
    def _not_a_users_run_dir(cls, value: str) -> str:
        """Training refuses such a folder too (``claim_run_dir``); this says so at load."""
        if "{flow_run" not in value:
            from neuron_parallel.checkpoint.output import RUN_DIR_FIX, check_output_dir

            check_output_dir(Path(value).expanduser(), fix=RUN_DIR_FIX)
        return value

    @field_validator("consolidated_dir")
    @classmethod
    def _not_a_users_folder(cls, value: str | None) -> str | None:
        """Consolidation refuses such a folder too (``claim_output_dir``); this says so at load,
        before hours of training, rather than after."""
        if value and "{flow_run" not in value:
            from neuron_parallel.checkpoint.output import check_output_dir

            check_output_dir(Path(value).expanduser(), fix="or unset it (output.dir/consolidated)")
        return value


ALLOWED_HUB_ENDPOINTS_ENV = "NEURON_FLOWS_ALLOWED_HUB_ENDPOINTS"
"""Comma list of Hub base URLs (scheme, host and port, as ``hub.endpoint`` is written) that
``hub.endpoint`` may name besides the public Hub and ``HF_ENDPOINT``. Read from the environment of
the worker and of ``neuron-flows``, never from a config: the operator, not whoever starts a run,
decides where the Hub token is sent."""


def allowed_hub_endpoints() -> set[str]:
    """The base URLs (``base_url`` form) ``hub.endpoint`` may name: the public Hub, ``HF_ENDPOINT``
    when set and each entry of ``NEURON_FLOWS_ALLOWED_HUB_ENDPOINTS``. A loopback endpoint is
    allowed only when one of these names it. Raises ValueError naming the variable whose entry
    is not a base URL."""
    allowed = {PUBLIC_HUB}
    for name in ("HF_ENDPOINT", ALLOWED_HUB_ENDPOINTS_ENV):
        for entry in os.environ.get(name, "").split(","):
            if entry.strip():
                try:
                    allowed.add(base_url(entry))
                except ValueError as e:
                    raise ValueError(
                        f"${name}: {entry.strip()!r} {e}; write base URLs (scheme://host[:port]) separated by "
                        "commas, e.g. https://hub.example.org,http://127.0.0.1:8080"
                    ) from None
    return allowed


class HubSection(_Section):
    """Where the consolidated model is uploaded."""

    repo_id: str | None = Field(None, description="Hub repo to upload to; empty skips the upload.")
    endpoint: str | None = Field(
        None,
        description="Hub URL; default the public Hub (or HF_ENDPOINT). Any other must be listed by the operator in "
        "NEURON_FLOWS_ALLOWED_HUB_ENDPOINTS, in the environment of the worker and of neuron-flows.",
    )
    private: bool = True
    token_secret: str | None = Field(
        None, description="Name of a Prefect Secret block holding the token; else HF_TOKEN."
    )
    upload: Literal["adapter", "merged", "both"] = Field(
        "adapter",
        description="LoRA runs: consolidate and upload the peft adapter, the base model with the adapters "
        "merged in, or both (the merged model in the repo's merged/ folder). Full fine-tuning uploads the model.",
    )

    @field_validator("endpoint")
    @classmethod
    def _allowed(cls, value: str | None) -> str | None:
        """The Hub token goes with every request: only over TLS, or to this machine itself, and
        only to an endpoint the operator allows (``allowed_hub_endpoints``)."""
        if value:
            try:
                url = base_url(value)
            except ValueError as e:
                shown = redact_url(value) if "@" in value else value  # user info may be a password
                raise ValueError(f"{shown!r} {e}; write the Hub's base URL, e.g. https://hub.example.org") from None
            if not encrypted_or_local(value):
                raise ValueError(
                    f"{value!r} is not an https:// URL; the Hub token would travel unencrypted. Use https://…, or "
                    "http:// only for a server on this machine (localhost)"
                )
            if url not in allowed_hub_endpoints():
                raise ValueError(
                    f"{value!r} is not a Hub endpoint this machine allows; the Hub token goes only to {PUBLIC_HUB}, "
                    f"$HF_ENDPOINT and the base URLs in ${ALLOWED_HUB_ENDPOINTS_ENV}: to allow it, the operator "
                    f"adds {url} to {ALLOWED_HUB_ENDPOINTS_ENV} in the environment of the worker and of "
                    "neuron-flows; or unset hub.endpoint"
                )
        return value

    @field_validator("repo_id")
    @classmethod
    def _valid_repo_id(cls, value: str | None) -> str | None:
        """A repo id the Hub would refuse is refused here, before any data is read or trained on."""
        if value:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(value)
            except HFValidationError as e:
                raise ValueError(
                    f"{value!r} is not a Hub repo id ({str(e).splitlines()[0]}); write it as "
                    "user-or-org/name with letters, digits, '-', '_' and '.', e.g. my-org/llama-ft"
                ) from None
        return value


# The gate is a dataclass inside the section: its fields' docstrings reach the form this way.
with_config(ConfigDict(use_attribute_docstrings=True))(GateConfig)
EvaluateSection = _section(EvaluateConfig, "evaluate")

SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "launch": LaunchConfig,
    "evaluate": EvaluateConfig,
}
"""The sections that are library dataclasses, by name."""


class FinetuneConfig(_Section):
    """A whole fine-tuning run."""

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    train: TrainSection = Field(default_factory=TrainSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    output: OutputSection = Field(default_factory=OutputSection)
    hub: HubSection = Field(default_factory=HubSection)
    evaluate: EvaluateSection = Field(default_factory=EvaluateSection)

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        """Every check the library's types make without the model; raises ValueError naming the fix."""
        self.library("model")
        data = self.library("data")
        self.to_launch()
        # An auto micro batch is chosen (and checked) with the layout.
        train = self.library("train", micro_batch_size=1)
        check_eval(data, train)
        check_objective(data, train)
        check_gate(self.library("evaluate"), has_eval_rows=data.has_eval, hub_repo_id=self.hub.repo_id)
        if train.resume_from and "{flow_run" not in train.resume_from and not Path(train.resume_from).exists():
            raise ValueError(
                f"train.resume_from={train.resume_from!r} does not exist; name a run directory or one of its "
                "checkpoint-<step> folders, or unset it"
            )
        check_pinned(
            self.pinned(),
            world_size=self.world_size,
            layer_split=self.parallel.layer_split,
            block_size=self.data.block_size,
        )
        layout = self.pinned_layout()
        if layout is not None:  # everything pinned: the batch rule is checkable now
            self.to_job(model_path="", dataset_path="", layout=layout)
        return self

    def library(self, section: str, **auto: Any):
        """Section ``section`` as the library's dataclass; ``auto`` gives values for the fields left
        ``auto`` (a field set in the config keeps its value; one in neither keeps the default)."""
        names = {f.name for f in dataclasses.fields(SECTIONS[section])}
        values = {k: v for k, v in getattr(self, section).model_dump().items() if v != AUTO and k in names}
        return SECTIONS[section](**{**auto, **values})

    def pinned(self) -> dict[str, Any]:
        """The planned fields that are set (not ``auto``), layout and micro batch together."""
        return {
            name: getattr(getattr(self, section), name)
            for section, names in PLANNED_FIELDS.items()
            for name in names
            if getattr(getattr(self, section), name) != AUTO
        }

    @property
    def world_size(self) -> int:
        return self.launch.nproc_per_node * self.launch.nnodes

    @property
    def hardware(self) -> str:
        return self.launch.hardware or DEVICE_HARDWARE[self.launch.device]

    def for_run(self, name: str, run_id: str) -> FinetuneConfig:
        """This config with ``{flow_run_name}`` and ``{flow_run_id}`` in the output paths filled in.
        The folders they name are checked by the preflight step (``steps.preflight``), not here, so
        that a refusal is that step's, with its message."""
        filled = {
            key: value.replace("{flow_run_name}", name).replace("{flow_run_id}", run_id)
            for key in ("dir", "consolidated_dir")
            if (value := getattr(self.output, key))
        }
        return self.model_copy(update={"output": self.output.model_copy(update=filled)})

    @property
    def consolidated_path(self) -> str:
        return self.output.consolidated_dir or str(Path(self.output.dir) / "consolidated")

    def pinned_layout(self) -> ResolvedLayout | None:
        """The layout as the config gives it when it pins every planned field; None when the plan
        step's search fills some (``tasks.steps.plan``)."""
        return pinned_layout(
            self.pinned(),
            world_size=self.world_size,
            mixed_precision=self.parallel.mixed_precision,
            layer_split=self.parallel.layer_split,
        )

    def to_job(
        self,
        *,
        model_path: str,
        dataset_path: str,
        layout: ResolvedLayout | CheckedLayout,
        eval_dataset_path: str | None = None,
        reference_path: str | None = None,
    ) -> JobConfig:
        """The library's view of this run, given the resolved model and dataset locations and the
        layout (``pinned_layout``, or the plan step's checked one)."""
        return JobConfig(
            model_path=model_path,
            dataset_path=dataset_path,
            eval_dataset_path=eval_dataset_path,
            reference_path=reference_path,
            output_dir=self.output.dir,
            data=self._job_data(),
            parallel=layout.parallel,
            train=self.library("train", micro_batch_size=layout.micro_batch_size),
            launch=self.to_launch(),
        )

    def _job_data(self) -> DataConfig:
        """The data section as the ranks get it: a chat template path made absolute, since the
        ranks (on other nodes too) load the job from their own working directory."""
        data = self.library("data")
        if data.chat_template:
            data = dataclasses.replace(data, chat_template=str(Path(data.chat_template).expanduser().resolve()))
        return data

    def to_launch(self) -> LaunchConfig:
        # On Kubernetes the first pod's stable name comes from the environment (deployments/trn2).
        endpoint = self.launch.rdzv_endpoint or os.environ.get("NEURON_FLOWS_RDZV_ENDPOINT")
        values = {f.name: getattr(self.launch, f.name) for f in dataclasses.fields(LaunchConfig)}
        return LaunchConfig(**{**values, "rdzv_endpoint": endpoint})

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> FinetuneConfig:
        """Read a YAML file (or start from defaults) and apply ``dotted.key=value`` overrides."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ValueError(f"config file {p} does not exist")
            try:
                data = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as e:
                where = getattr(e, "problem_mark", None)
                at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                raise ValueError(f"config file {p} is not valid YAML: {problem}{at}; fix the syntax there") from None
            if not isinstance(data, dict):
                raise ValueError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
        for item in overrides or []:
            _apply_override(data, item)
        _check_keys(data, cls, "")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(_explain(e)) from None


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {item!r}: write it as dotted.key=value, e.g. --set parallel.tp=2")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {item!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None


def _check_keys(data: Any, model: type[BaseModel], prefix: str) -> None:
    """Unknown keys are an error that lists the valid keys closest to the one given."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            here = sorted(model.model_fields)
            near = difflib.get_close_matches(key, here, n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(prefix + n for n in near)}? " if near else ""
            derived = f"{DERIVED[prefix + key]}; " if prefix + key in DERIVED else ""
            raise ValueError(
                f"unknown config key {prefix + key!r}; {derived}{hint}valid keys here: "
                f"{', '.join(prefix + n for n in here)}"
            )
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            _check_keys(value, sub, f"{prefix}{key}.")


def _explain(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "invalid config: " + "; ".join(lines)
