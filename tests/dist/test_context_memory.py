"""The planner's memory per rank for a context-parallel layout holds on CPU.

A cp2 job (ZeRO-1 over the dp × cp ranks) trains rows of the tiny corpus through the real entry
point with ``train.profile_memory``: every rank measures its peak tensor memory with
``neuron_parallel.memprof`` and writes it to ``memory.json`` beside the planner's prediction for
that rank (``neuron_parallel.planning.memory.job_rank_memory``): each rank's ``S/cp`` tokens, the
K/V of the whole row, CPU's blocked attention (``CONTEXT_QUERY_BLOCK`` local queries at a time,
recomputed in backward: the K/V repeated for every query head and the mask of one block), the
optimizer state sharded over both ranks and the gradient reducer's buffers. Rows of 512 tokens
give each rank 256 local queries, one block; rows of 2048 give 1024, two blocks (on a copy of the
tiny model whose position range, a number of its config under the default rotary embedding, is
raised to 2048).
"""

import json
import shutil
from pathlib import Path

import pytest

from neuron_parallel.run_files import MEMORY_FILE
from neuron_parallel.utils import CONTEXT_QUERY_BLOCK

from ..conftest import torchrun, write_job


@pytest.mark.parametrize("block", [512, pytest.param(2048, marks=pytest.mark.slow)])  # 2048: two query blocks a rank
def test_cp2_memory_per_rank_is_within_5_percent_of_the_plan(tiny_world, tmp_path, block):
    from neuron_parallel.data import tokenize_dataset

    assert -(-block // 2 // CONTEXT_QUERY_BLOCK) == (1 if block == 512 else 2)  # query blocks per rank
    model = tiny_world["model"]
    config = json.loads((Path(model) / "config.json").read_text())
    if block > config["max_position_embeddings"]:
        model = shutil.copytree(model, tmp_path / "model")
        (model / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=block)))
    rows = tokenize_dataset(
        source=tiny_world["corpus"], tokenizer_dir=model, block_size=block, cache_dir=tmp_path / "ds"
    )
    run = tmp_path / "run"
    train = dict(max_steps=2, save_every=0, micro_batch_size=4, global_batch_size=4, profile_memory=True)
    job = write_job(
        run, str(model), rows.path, world=2, block_size=block, parallel=dict(cp=2, zero_1=True), train=train
    )
    # rows of 2048 in processes of their own: a warm rank may still hold an earlier job's model
    # and optimizer state until Python's collector runs, and the peak counts every live tensor
    proc = torchrun(job, 2, timeout=300, fresh=block > 512)
    assert proc.returncode == 0, proc.tail()
    ranks = json.loads((run / MEMORY_FILE).read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["measured_bytes"] > 40 * 2**20, r  # activations of 4·S/2 tokens a rank: a real measurement
        assert r["predicted"]["comm_buffers"] > 0 and r["predicted"]["activations"] > 0, r
        mib = {k: f"{r[k] / 2**20:.2f} MiB" for k in ("measured_bytes", "predicted_bytes")}
        print(f"S={block} rank {r['rank']}: {mib}")
        assert abs(r["predicted_bytes"] / r["measured_bytes"] - 1) <= 0.05, r
