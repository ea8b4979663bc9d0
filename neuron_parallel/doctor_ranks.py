"""What ``neuron-flows doctor`` (``neuron_parallel.doctor``) runs on the device, in processes of
its own: the host's process never touches the device, which a rank then could not have (the
Neuron runtime reserves a NeuronCore for the process that opens it until that process ends).

    python -m neuron_parallel.doctor_ranks one SPEC.json              one process, one device
    torchrun ... -m neuron_parallel.doctor_ranks all SPEC.json [JOB]  every rank of the layout

``one``: a tensor there and back, a bf16 autocast matmul, scaled-dot-product attention at the
run's shapes (and which kernel ran), the allocator's statistics after a synchronize. ``all``:
all_reduce, all_gather, reduce_scatter and broadcast on the dp, tp and pp groups of the layout,
``batch_isend_irecv`` around a ring, a barrier, object collectives; then, given a training job,
the job itself (``neuron_parallel.train.train_job``) in the same process group, for the doctor's
parity smoke. Each rank reports every check as one line: ``DOCTOR_PREFIX`` and a JSON object
(``rank``, ``name``, ``ok``, ``detail``, ``seconds``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DOCTOR_PREFIX = "@@neuron-doctor "
"""What starts a rank's report of one check: one JSON object follows."""
AXES = ("dp", "tp", "pp")


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What the rank jobs need: the device, the layout's degrees, how long a collective may wait,
    and the attention shapes of one rank (batch, query and key/value heads, sequence, head dim)."""

    device: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    timeout_s: float = 300.0
    batch: int = 1
    heads: int = 4
    seq_len: int = 128
    head_dim: int = 32
    planned_attention: str = "flash"
    """The attention path the planner counts for these shapes (``planning.attention.attention_path``)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def load(cls, path: str | Path) -> RankSpec:
        return cls(**json.loads(Path(path).read_text()))


def report(name: str, fn: Callable[[], str]) -> bool:
    """Run one check and print its line: ok with ``fn``'s detail, or failed with the error's first
    line (``AssertionError``: what differed). Returns whether it passed."""
    from .utils import write_line

    t0 = time.perf_counter()
    try:
        detail, ok = fn(), True
    except Exception as e:  # a check reports what went wrong; it never ends the rank
        text = str(e).strip().splitlines()
        detail, ok = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": "), False
    rank = int(os.environ.get("RANK", "0"))
    line = {"rank": rank, "name": name, "ok": ok, "detail": detail, "seconds": round(time.perf_counter() - t0, 3)}
    write_line(DOCTOR_PREFIX + json.dumps(line))
    return ok


# One process -------------------------------------------------------------------------------------


def _roundtrip(device) -> str:
    import torch

    x = torch.arange(1 << 12, dtype=torch.float32)
    back = (x.to(device) * 2 + 1).cpu()
    assert torch.equal(back, x * 2 + 1), f"{device} returned other values than it was given"
    return f"{device}: {x.numel()} floats there, computed on and back, exact"


AUTOCAST_TOLERANCE = 2e-2
"""Largest error of a bf16 matmul of 256-wide random matrices, relative to the result's largest
entry: bf16 keeps 8 significant bits (relative rounding 2^-8 ≈ 4e-3 per input); a product in
another precision or of other values is off by far more."""


def _autocast_matmul(device) -> str:
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(256, 256, generator=gen) for _ in range(2))
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        c = a.to(device) @ b.to(device)
    assert c.dtype == torch.bfloat16, f"autocast gave a {c.dtype} matmul, not bfloat16"
    want = a.double() @ b.double()
    err = ((c.double().cpu() - want).abs().max() / want.abs().max()).item()
    assert err <= AUTOCAST_TOLERANCE, f"max error {err:.2e} of the largest entry, above {AUTOCAST_TOLERANCE:g}"
    return f"bf16 result on {device}, max error {err:.1e} of the largest entry (bound {AUTOCAST_TOLERANCE:g})"


SDPA_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}
"""Largest error of the attention output against a float64 reference on the host, relative to
the reference's largest entry, by input dtype (flash kernels reorder the sums; bf16 keeps 8
significant bits)."""


def _sdpa(device, spec: RankSpec) -> str:
    """Causal attention without a mask (the path a one-document row takes) at the rank's shapes,
    under the profiler, which names the attention operator the dispatcher chose."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    shape = (spec.batch, spec.heads, spec.seq_len, spec.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    qd, kd, vd = (t.to(device) for t in (q, k, v))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
        first = out[0, 0].float().cpu()  # reading it back waits for the device
    ops = sorted({e.key for e in prof.key_averages() if "attention" in e.key and e.key != _SDPA_OP})
    # The reference for the first (batch, head): float64 on the host, scores of one head only.
    q0, k0, v0 = (t[0, 0].double() for t in (q, k, v))
    scores = (q0 @ k0.T) / math.sqrt(spec.head_dim)
    causal = torch.ones(spec.seq_len, spec.seq_len, dtype=torch.bool).tril()
    want = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v0
    err = ((first.double() - want).abs().max() / want.abs().max()).item()
    bound = SDPA_TOLERANCE[str(dtype).removeprefix("torch.")]
    assert err <= bound, f"output off by {err:.2e} of its largest entry (bound {bound:g}); kernels {ops}"
    kernel = ", ".join(ops) or "no attention operator recorded"
    dims = "×".join(map(str, shape))
    return (
        f"{dims} (batch×heads×seq×head_dim) {str(dtype).removeprefix('torch.')}, causal: ran {kernel}; "
        f"error {err:.1e} (bound {bound:g}); the planner counts the {spec.planned_attention} path here"
    )


_SDPA_OP = "aten::scaled_dot_product_attention"
"""The dispatching operator; the kernel it chose is recorded beneath it."""


def _memory(device) -> str:
    from .reporting import peak_memory_bytes

    peak = peak_memory_bytes(device)  # synchronizes the device first
    if device.type == "cpu":
        assert peak, "no peak resident set size"
        return f"peak resident set {peak / 2**20:.0f} MiB (CPU tensors have no allocator statistics)"
    assert peak is not None, f"the {device.type} module has no max_memory_allocated and torch.accelerator none"
    assert peak > 0, f"{device}'s allocator reports a peak of 0 bytes after this process's allocations"
    return f"{device}: peak {peak / 2**20:.1f} MiB allocated, read after a synchronize"


def one_rank(spec: RankSpec) -> bool:
    """The one-process checks, in a process group of one (the neuron device must not be touched
    before ``init_process_group``); whether every one passed."""
    from .mesh import close_distributed, init_distributed, local_device

    init_distributed(spec.device, timeout_s=spec.timeout_s)
    device = local_device(spec.device)
    results = [
        report("one rank: tensor on the device", lambda: _roundtrip(device)),
        report("one rank: bf16 autocast matmul", lambda: _autocast_matmul(device)),
        report("one rank: scaled_dot_product_attention", lambda: _sdpa(device, spec)),
        report("one rank: memory statistics", lambda: _memory(device)),
    ]
    close_distributed()
    return all(results)


# Every rank --------------------------------------------------------------------------------------


def _collectives(group, device) -> str:
    """all_reduce, all_gather, reduce_scatter and broadcast on ``group``, each result checked."""
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(group), dist.get_rank(group)
    block = 4
    done = []

    def full(value, size=block):
        return torch.full((size,), float(value), device=device)

    t = full(r + 1)
    dist.all_reduce(t, group=group)
    assert torch.equal(t.cpu(), full(n * (n + 1) / 2).cpu()), f"all_reduce gave {t.cpu().tolist()}"
    done.append("all_reduce")
    out = full(0, n * block)
    dist.all_gather_into_tensor(out, full(r + 1), group=group)
    want = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(block)
    assert torch.equal(out.cpu(), want), f"all_gather gave {out.cpu().tolist()}"
    done.append("all_gather")
    mine = full(0)
    source = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(block) * (r + 1)
    dist.reduce_scatter_tensor(mine, source.to(device), group=group)
    assert torch.equal(mine.cpu(), full((r + 1) * n * (n + 1) / 2).cpu()), f"reduce_scatter gave {mine.cpu().tolist()}"
    done.append("reduce_scatter")
    t = full(7 if r == 0 else 0)
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    assert torch.equal(t.cpu(), full(7).cpu()), f"broadcast gave {t.cpu().tolist()}"
    done.append("broadcast")
    return f"{', '.join(done)} over {n} rank{'s' * (n > 1)}, results exact"


def _ring(group, device) -> str:
    """Each rank sends its global rank to the next one of ``group`` and receives the previous
    one's, with ``batch_isend_irecv`` (what pipeline schedules issue)."""
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return "not applicable: the group has one rank"
    nxt, prev = (dist.get_global_rank(group, (r + d) % n) for d in (1, -1))
    send = torch.full((4,), float(dist.get_rank()), device=device)
    recv = torch.zeros(4, device=device)
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prev, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.equal(recv.cpu(), torch.full((4,), float(prev))), f"received {recv.cpu().tolist()} from rank {prev}"
    return f"a ring of {n} ranks, each sending to the next and receiving from the previous"


def _barrier() -> str:
    import torch.distributed as dist

    dist.barrier()
    return f"world group of {dist.get_world_size()} ranks"


def _objects() -> str:
    import torch.distributed as dist

    n = dist.get_world_size()
    everyone = [None] * n
    dist.all_gather_object(everyone, {"rank": dist.get_rank(), "host": socket.gethostname()})
    assert [e["rank"] for e in everyone] == list(range(n)), f"all_gather_object gave {everyone}"
    shared = [{"from": dist.get_rank()}]
    dist.broadcast_object_list(shared, src=0)
    assert shared[0] == {"from": 0}, f"broadcast_object_list gave {shared[0]}"
    hosts = sorted({e["host"] for e in everyone})
    return f"all_gather_object and broadcast_object_list over {n} ranks on {len(hosts)} host(s)"


def all_ranks(spec: RankSpec, job_path: str | None = None) -> bool:
    """The every-rank checks on the layout's groups, then, given ``job_path``, that training job
    in the same process group; whether every check passed."""
    from .mesh import ParallelDims, close_distributed, exit_rank, init_distributed, local_device

    init_distributed(spec.device, timeout_s=spec.timeout_s)
    device = local_device(spec.device)
    dims = ParallelDims(dp=spec.dp, pp=spec.pp, tp=spec.tp, device_type=spec.device, timeout_s=spec.timeout_s)
    results = []
    for axis in AXES:
        size = getattr(spec, axis)
        results.append(
            report(
                f"all ranks: collectives on the {axis} groups ({size} rank{'s' * (size > 1)} each)",
                lambda axis=axis: _collectives(dims.group(axis), device),
            )
        )
    ring_axis = "pp" if spec.pp > 1 else "dp" if spec.dp > 1 else "tp"
    results.append(
        report(f"all ranks: batch_isend_irecv ({ring_axis} groups)", lambda: _ring(dims.group(ring_axis), device))
    )
    results.append(report("all ranks: barrier", _barrier))
    results.append(report("all ranks: object collectives", _objects))
    if job_path is not None:
        from .config import JobConfig

        if not report("all ranks: parity run on the device", lambda: _train(JobConfig.load(job_path))):
            exit_rank(1)  # torchrun ends the other ranks, which would wait for this one's collectives
    close_distributed()
    return all(results)


def _train(job) -> str:
    from .train import train_job

    train_job(job)
    return f"{job.train.max_steps} steps trained into {job.output_dir}"


def main(argv: list[str] | None = None) -> None:
    from .mesh import exit_rank

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or argv[0] not in ("one", "all") or (argv[0] == "one" and len(argv) == 3):
        raise SystemExit("usage: python -m neuron_parallel.doctor_ranks one SPEC.json | all SPEC.json [JOB.json]")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spec = RankSpec.load(argv[1])
    ok = one_rank(spec) if argv[0] == "one" else all_ranks(spec, argv[2] if len(argv) == 3 else None)
    exit_rank(0 if ok else 1)


if __name__ == "__main__":
    main()
