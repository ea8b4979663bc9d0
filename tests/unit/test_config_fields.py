"""Every field of the library's config dataclasses is reachable from a YAML file, from `--set`
and from the flow's parameter schema (the Prefect UI form), with the library's docstring."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from neuron_flows.tasks.config import DERIVED, SECTIONS, FinetuneConfig
from neuron_parallel.config import LoraConfig, PreferenceConfig
from neuron_parallel.evaluate import GateConfig
from neuron_parallel.tiny import TEMPLATES

BASE = {"launch": {"nproc_per_node": 4}}
"""Four ranks, so that tp=2 or pp=2 divide the world."""

SAMPLES = {
    "model.name_or_path": "org/base-model",
    "model.revision": "v2",
    "data.source": ["a.jsonl", "b.parquet"],
    "data.text_field": "body",
    "data.split": "validation",
    "data.config": "wikitext-2-raw-v1",
    "data.revision": "v1.0",
    "data.block_size": 256,
    "data.cache_dir": "/tmp/ds-cache",
    "data.format": "chat",
    "data.messages_field": "conversations",
    "data.prompt_field": "question",
    "data.input_field": "context",
    "data.response_field": "answer",
    "data.chosen_field": "better",
    "data.rejected_field": "worse",
    "data.chat_template": str(TEMPLATES / "chatml.jinja"),
    "data.train_on_prompt": True,
    "data.packing": False,
    "data.weights": [2.0, 1.0],
    "data.seed": 3,
    "data.eval_source": "eval.jsonl",
    "data.eval_split": "validation",
    "data.eval_fraction": 0.1,
    "parallel.tp": 2,
    "parallel.pp": 2,
    "parallel.cp": 2,
    "parallel.zero_1": True,
    "parallel.sequence_parallel": True,
    "parallel.num_microbatches": 4,
    "parallel.pipeline_schedule": "gpipe",
    "parallel.virtual_stages": 2,
    "parallel.layer_split": [1, 3],
    "parallel.activation_checkpointing": 2,
    "parallel.mixed_precision": "bf16",
    "train.max_steps": 7,
    "train.save_every": 3,
    "train.keep_checkpoints": 5,
    "train.async_save": True,
    "train.seed": 11,
    "train.global_batch_size": 32,
    "train.micro_batch_size": 2,
    "train.lr": 5.0e-4,
    "train.warmup_steps": 2,
    "train.lr_schedule": "constant",
    "train.min_lr_ratio": 0.05,
    "train.weight_decay": 0.1,
    "train.betas": [0.8, 0.99],
    "train.max_grad_norm": 0.5,
    "train.optimizer": "sgd",
    "train.log_every": 3,
    "train.eval_every": 5,
    "train.lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
    "train.early_stopping_patience": 3,
    "train.objective": "simpo",
    "train.preference": {"beta": 2.0, "loss_type": "ipo", "label_smoothing": 0.1, "gamma": 1.0},
    "train.resume_from": str(Path(__file__).resolve().parent),  # any existing folder: it must exist
    "train.compile": True,
    "train.profile_memory": True,
    "train.report_to": ["tensorboard", "mlflow"],
    "launch.device": "cuda",
    "launch.nproc_per_node": 8,
    "launch.nnodes": 2,
    "launch.rdzv_endpoint": "node-0:29400",
    "launch.rdzv_id": "job-7",
    "launch.omp_num_threads": 3,
    "launch.memory_fraction": 0.8,
    "launch.timeout_s": 600.0,
    "launch.first_step_timeout_s": 5400.0,
    "evaluate.prompts": __file__,  # any existing file: it must exist
    "evaluate.max_new_tokens": 16,
    "evaluate.lm_eval_tasks": ["arc_easy", "hellaswag"],
    "evaluate.lm_eval_limit": 50,
    "evaluate.gate": {"metric": "eval_loss", "baseline": "hub", "min_improvement": -0.05},
}
"""A valid value, other than the default, for every settable library field."""

NEEDS = {
    "parallel.sequence_parallel": {"parallel.tp": 2},
    "parallel.virtual_stages": {"parallel.pipeline_schedule": "interleaved_1f1b"},
    "parallel.layer_split": {"parallel.pp": 2},
    "launch.nnodes": {"launch.rdzv_endpoint": "node-0:29400"},
    "data.prompt_field": {"data.format": "instruction"},
    "data.input_field": {"data.format": "instruction"},
    "data.response_field": {"data.format": "instruction"},
    "data.weights": {"data.source": ["a.jsonl", "b.parquet"]},
    "data.chosen_field": {"data.format": "preference", "train.objective": "dpo"},
    "data.rejected_field": {"data.format": "preference", "train.objective": "dpo"},
    "train.objective": {"data.format": "preference"},
    "train.eval_every": {"data.eval_fraction": 0.1},
    "train.early_stopping_patience": {"train.eval_every": 5, "data.eval_fraction": 0.1},
    "evaluate.gate": {"data.eval_fraction": 0.1, "hub.repo_id": "org/model-ft"},
}
"""Fields whose sample is valid only together with another value."""


def _library_fields() -> list[tuple[str, dataclasses.Field]]:
    return [
        (f"{section}.{f.name}", f)
        for section, kind in SECTIONS.items()
        for f in dataclasses.fields(kind)
        if f"{section}.{f.name}" not in DERIVED
    ]


def _nested(dotted: dict) -> dict:
    out: dict = {"launch": dict(BASE["launch"])}
    for key, value in dotted.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = value
    return out


def _value(config: FinetuneConfig, key: str):
    section, name = key.split(".")
    auto = {"micro_batch_size": 1} if section == "train" and config.train.micro_batch_size == "auto" else {}
    return getattr(config.library(section, **auto), name)


def _expected(key: str):
    value = SAMPLES[key]
    if key == "train.lora":
        return LoraConfig(**value)
    if key == "evaluate.gate":
        return GateConfig(**value)
    if key == "train.preference":
        return PreferenceConfig(**value)
    return tuple(value) if key == "train.betas" else value


def test_every_library_field_has_a_sample_that_is_not_its_default():
    keys = [key for key, _ in _library_fields()]
    assert sorted(keys) == sorted(SAMPLES), "a library config field has no sample here (or a sample has no field)"
    for key, f in _library_fields():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert _expected(key) != default, key


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_field_from_yaml(key, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_nested({**NEEDS.get(key, {}), key: SAMPLES[key]})))
    assert _value(FinetuneConfig.load(path), key) == _expected(key)


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_field_from_set(key):
    sets = {**NEEDS.get(key, {}), key: SAMPLES[key]}
    overrides = ["launch.nproc_per_node=4"] + [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in sets.items()
    ]
    if key == "launch.nproc_per_node":
        overrides = overrides[1:]
    config = FinetuneConfig.load(None, overrides)
    assert _value(config, key) == _expected(key)


@pytest.fixture(scope="module")
def flow_schema():
    from prefect.utilities.callables import parameter_schema

    from neuron_flows.flows.finetune import finetune

    return finetune, parameter_schema(finetune.fn).model_dump()


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_field_from_the_ui_form(key, flow_schema):
    """The form Prefect draws has the field with the library's docstring, and a value entered
    there reaches the library."""
    flow, schema = flow_schema
    section, name = key.split(".")
    kind = SECTIONS[section]
    prop = schema["definitions"][kind.__name__.replace("Config", "Section")]["properties"][name]
    doc = next(f for k, f in _library_fields() if k == key)
    assert prop.get("description"), f"{key} has no description in the form"
    assert prop["description"].split()[0] in _docstring(kind, doc.name)
    params = flow.validate_parameters({"config": _nested({**NEEDS.get(key, {}), key: SAMPLES[key]})})
    assert _value(params["config"], key) == _expected(key)


def _docstring(kind: type, name: str) -> str:
    """The attribute docstring under ``name`` in the dataclass source."""
    import inspect

    src = inspect.getsource(kind)
    after = src.split(f"    {name}:", 1)[1]
    return after.split('"""')[1]


def test_the_form_takes_auto_for_planned_fields_only(flow_schema):
    _, schema = flow_schema
    autos = {
        f"{section.removesuffix('Section').lower()}.{name}"
        for section, body in schema["definitions"].items()
        for name, prop in body.get("properties", {}).items()
        if any(alt.get("const") == "auto" for alt in prop.get("anyOf", []))
    }
    from neuron_parallel.config import PLANNED_FIELDS

    assert autos == {f"{s}.{n}" for s, names in PLANNED_FIELDS.items() for n in names}


def test_derived_keys_are_refused_with_the_rule():
    with pytest.raises(ValueError, match=r"train.grad_accum.*global_batch_size / \(micro_batch_size × dp\)"):
        FinetuneConfig.load(None, ["train.grad_accum=2"])
    with pytest.raises(ValueError, match=r"parallel.dp.*world size / \(cp × tp × pp\)"):
        FinetuneConfig.load(None, ["parallel.dp=2"])
