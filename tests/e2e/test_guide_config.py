"""The optimum-neuron guide's example as a config (configs/tiny-qwen2-wikitext-cpu.yaml): a
Qwen2-style model with tied embeddings on the wikitext-2-raw-v1 config of a dataset folder laid
out like the Hub's, 1024-token blocks, tp2 + ZeRO-1, bf16, through `neuron-flows train`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from ..conftest import ROOT, read_metrics


@pytest.mark.slow
def test_guide_config_trains_and_consolidates_a_tied_qwen2(tiny_world, tmp_path):
    run = tmp_path / "run"
    sets = {
        "model.name_or_path": tiny_world["qwen2"],
        "data.source": tiny_world["wikitext"],
        "data.cache_dir": tmp_path / "datasets",
        "train.max_steps": 3,
        "train.save_every": 0,
        "output.dir": run,
    }
    cmd = [sys.executable, "-m", "neuron_flows.flows.cli", "train", str(ROOT / "configs/tiny-qwen2-wikitext-cpu.yaml")]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    start = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("start: "))[7:])
    assert (start["tp"], start["zero_1"], start["dp"], start["global_batch_size"]) == (2, True, 2, 4)
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(m["loss"]) for m in metrics)

    out = tmp_path / "hf"
    consolidate = [sys.executable, "-m", "neuron_flows.flows.cli", "consolidate", str(run), str(out)]
    assert subprocess.run(consolidate, capture_output=True, text=True, timeout=120).returncode == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_the_dataset_folder_is_read_by_its_config_name(tiny_world, tmp_path):
    """wikitext-2-raw-v1 and wikitext-103-raw-v1 are different data: the config name matters."""
    from neuron_parallel.data import tokenize_dataset

    kw = dict(source=tiny_world["wikitext"], tokenizer_dir=tiny_world["qwen2"], block_size=1024, cache_dir=tmp_path)
    small = tokenize_dataset(config="wikitext-2-raw-v1", **kw)
    large = tokenize_dataset(config="wikitext-103-raw-v1", **kw)
    assert large.num_tokens == 3 * small.num_tokens  # the 103 config repeats the training text 3 times
