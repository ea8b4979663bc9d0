"""The device measurements of ``bench/gpu.sh`` beyond the training runs (``gpu_bench.py`` calls
them and reports what they return):

* :func:`matmul_flops`: the bf16 matmul rate this device reaches in this run, the practical
  ceiling MFU is also stated against;
* :func:`packed_attention`: attention over rows packed from several documents, the trainer's path
  (``neuron_parallel.models.causal_lm``: ``CausalLMStage.document_mask`` and ``attention``;
  compiled FlexAttention with a document block mask on CUDA, the explicit additive mask on CPU)
  against scaled-dot-product attention with the explicit boolean mask (Hugging Face's
  ``sdpa_attention_forward``, grouped K/V repeated): time, peak memory, forward and backward
  parity, and both against an fp32 reference;
* :func:`train_steps`: optimizer steps of the trainer itself (``neuron_parallel.train.Trainer``)
  in this process, a rank of a world of one, with the host syncs of each step counted by
  :class:`SyncCounter` (CUDA's sync debug mode) and the losses read after the last step.

Every function runs on CPU too (the dry run), where what has no CPU counterpart says so.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

NOT_APPLICABLE = "not applicable"
SYNC_WARNING = "synchronizing CUDA operation"
"""What torch's warning says for every host sync under ``torch.cuda.set_sync_debug_mode("warn")``."""
DOCUMENTS_PER_ROW = 4


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device: torch.device, iters: int) -> float:
    """Mean seconds of ``fn()`` over ``iters`` calls, timed on the device (CUDA events) or the
    wall clock (CPU), after a synchronize."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _peak_bytes(fn, device: torch.device) -> int | str:
    """Bytes the device allocator held at most while ``fn()`` ran, beyond what it held before."""
    if device.type != "cuda":
        return NOT_APPLICABLE
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


# --------------------------------------------------------------------------------------------
# matmul


def matmul_flops(device: torch.device) -> dict:
    """FLOP/s of a square bf16 matmul (8192³ on CUDA; 512³ on CPU, only to run the path): the best
    of 5 rounds, each timed over many products after warm-up."""
    n, iters = (8192, 20) if device.type == "cuda" else (512, 4)
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)

    def product():
        torch.matmul(a, b, out=out)

    _seconds(product, device, 3)
    best = min(_seconds(product, device, iters) for _ in range(5))
    how = "CUDA events" if device.type == "cuda" else "wall clock"
    return {"n": n, "dtype": "bfloat16", "iters": iters, "seconds": best, "flops_per_s": 2 * n**3 / best, "how": how}


# --------------------------------------------------------------------------------------------
# packed-row attention


def document_positions(rows: int, seq: int, documents: int, seed: int = 0) -> torch.Tensor:
    """Position ids ``(rows, seq)`` of rows packed from ``documents`` documents each, of random
    lengths (seeded): ``0 .. len-1`` per document."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        cuts = torch.randperm(seq - 1, generator=g)[: documents - 1].add(1).sort().values.tolist()
        bounds = [0, *cuts, seq]
        out.append(torch.cat([torch.arange(e - s) for s, e in zip(bounds, bounds[1:])]))
    return torch.stack(out)


def _stage(config):
    """A one-layer ``CausalLMStage`` of ``config`` on the meta device, in training mode: the object
    whose ``document_mask`` chooses the trainer's attention path, and whose attention module
    Hugging Face's attention functions read their settings from."""
    from neuron_parallel.models.causal_lm import CausalLMStage, build_meta_model

    meta = build_meta_model(copy.deepcopy(config))  # it sets the config's attention implementation
    stage = CausalLMStage(meta, range(1), first=True, last=True)
    return stage.train()


def _difference(a: torch.Tensor, b: torch.Tensor) -> dict:
    """``max |a - b|``, and that over ``max |b|``."""
    diff = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item()
    return {"max_abs": diff, "max_rel": diff / scale if scale else 0.0}


def _mask_bytes(mask) -> int:
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(mask, BlockMask):
        return sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, torch.Tensor))
    return mask.numel() * mask.element_size()


def packed_attention(config, device: torch.device, rows: int, seq: int) -> dict:
    """The trainer's attention over rows of :data:`DOCUMENTS_PER_ROW` documents (``ours``) against
    SDPA with the explicit boolean mask (``explicit_sdpa``), in bf16, with the heads of ``config``:
    per path the mask (kind, bytes, build time), the time and peak memory of a forward and of a
    forward + backward; the parity of outputs and of the gradients of query, key and value
    between the two paths and of each path against the explicit mask in fp32. On CPU the
    trainer's path is the explicit additive mask; FlexAttention's forward (eager: torch has no
    FlexAttention backward on CPU) is compared there as ``flex_forward``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from neuron_parallel.models.causal_lm import attention, document_block_mask, document_causal_mask

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    stage = _stage(config)
    module = stage.model.layers["0"].self_attn
    positions = document_positions(rows, seq, DOCUMENTS_PER_ROW).to(device)
    g = torch.Generator(device=device).manual_seed(1)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)

    # bf16 values, and the same values in fp32 for the reference, which then differs by arithmetic only
    qkv = [leaf(rows, h, seq, head_dim) for h in (heads, kv_heads, kv_heads)]
    grad_out = leaf(rows, seq, heads, head_dim)
    inputs = {dtype: ([t.to(dtype) for t in qkv], grad_out.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    scaling = head_dim**-0.5

    def build(path: str):
        if path == "ours":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return stage.document_mask(positions, torch.float32)
        if path == "flex_forward":
            return document_block_mask(positions)
        return document_causal_mask(positions)

    def run(mask, dtype, backward: bool):
        leaves, grad = inputs[dtype]
        q, k, v = (t.detach().requires_grad_(backward) for t in leaves)
        with warnings.catch_warnings():  # eager FlexAttention on CPU says it is not the fused kernel: known
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out, _ = attention(module, q, k, v, mask, scaling=scaling)
        if not backward:
            return out.detach(), None
        out.backward(grad)
        return out.detach(), [t.grad for t in (q, k, v)]

    cuda = device.type == "cuda"
    ref_mask = build("explicit_sdpa")
    with sdpa_kernel(SDPBackend.MATH):  # the reference: fp32 throughout (no fused kernel, no TF32 here)
        ref32_out, ref32_grads = run(ref_mask, torch.float32, True)
    paths = ["ours", "explicit_sdpa"] + ([] if cuda else ["flex_forward"])
    result = {
        "rows": rows,
        "seq": seq,
        "documents_per_row": DOCUMENTS_PER_ROW,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": "bfloat16",
        "paths": {},
    }
    outputs = {}
    for path in paths:
        backward = path != "flex_forward"
        mask = build(path)
        for grad_mode in {False, backward}:  # warm-up: compiles FlexAttention on CUDA, with and without grad
            run(mask, torch.bfloat16, grad_mode)
        out, grads = run(mask, torch.bfloat16, backward)
        outputs[path] = (out, grads)
        iters = 10 if cuda else 2
        entry = {
            "mask": type(mask).__name__ if not isinstance(mask, torch.Tensor) else f"tensor {mask.dtype}",
            "mask_bytes": _mask_bytes(mask),
            "mask_build_s": _seconds(lambda p=path: build(p), device, iters),
            "forward_s": _seconds(lambda m=mask: run(m, torch.bfloat16, False), device, iters),
            "forward_peak_bytes": _peak_bytes(lambda m=mask: run(m, torch.bfloat16, False), device),
            "vs_fp32_explicit": {"out": _difference(out, ref32_out)},
        }
        if backward:
            entry["forward_backward_s"] = _seconds(lambda m=mask: run(m, torch.bfloat16, True), device, iters)
            entry["forward_backward_peak_bytes"] = _peak_bytes(lambda m=mask: run(m, torch.bfloat16, True), device)
            for name, grad, ref in zip("qkv", grads, ref32_grads):
                entry["vs_fp32_explicit"][f"grad_{name}"] = _difference(grad, ref)
        else:
            entry["forward_backward_s"] = f"{NOT_APPLICABLE}: torch has no FlexAttention backward on CPU"
        result["paths"][path] = entry
    (ours, ours_grads), (ref, ref_grads) = outputs["ours"], outputs["explicit_sdpa"]
    parity = {"out": _difference(ours, ref)}
    parity.update({f"grad_{n}": _difference(a, b) for n, a, b in zip("qkv", ours_grads, ref_grads)})
    result["ours_vs_explicit_sdpa"] = parity
    if "flex_forward" in outputs:
        result["flex_forward_vs_explicit_sdpa"] = {"out": _difference(outputs["flex_forward"][0], ref)}
    # The trainer's path is as exact as the explicit mask: within twice its error against fp32.
    errors = [(result["paths"][p]["vs_fp32_explicit"], p) for p in ("ours", "explicit_sdpa")]
    result["ours_as_exact_as_explicit"] = all(
        errors[0][0][key]["max_abs"] <= 2 * errors[1][0][key]["max_abs"] + 1e-6 for key in errors[0][0]
    )
    return result


# --------------------------------------------------------------------------------------------
# the trainer's own steps: host syncs and losses


class SyncCounter:
    """Counts the host syncs of what runs inside it on CUDA: ``torch.cuda.set_sync_debug_mode``
    ("warn") makes every synchronizing CUDA call (a device → host copy such as ``.item()``, a
    synchronous host → device copy, a stream or device synchronize) issue a warning; each is
    counted with where Python called it from. On another device ``count`` is None."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.count: int | None = None
        self.sites: Counter = Counter()

    def __enter__(self) -> SyncCounter:
        if self.device.type == "cuda":
            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type != "cuda":
            return
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        hits = [w for w in self._seen if SYNC_WARNING in str(w.message)]
        self.count = len(hits)
        self.sites.update(f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}" for w in hits)


def train_steps(job, steps: int, *, count_syncs: bool, tf32: bool = True) -> dict:
    """``steps`` optimizer steps of the trainer (``Trainer.train_step``, what a plain step runs)
    on a fresh run of ``job`` in this process (a world of one), no checkpoint written. Returns
    each step's loss and gradient norm (the trainer's own rows, read once after the last step)
    and, with ``count_syncs``, each step's host syncs and their sites. ``tf32=False`` turns
    CUDA's TF32 matmuls off after the engine is built (an fp32 reference run)."""
    from neuron_parallel import train
    from neuron_parallel.mesh import ParallelDims, init_distributed
    from neuron_parallel.step_log import StepRows

    init_distributed(job.device, timeout_s=job.launch.timeout_s)
    pc = job.parallel
    dims = ParallelDims(dp=pc.dp, pp=pc.pp, tp=pc.tp, device_type=job.device, timeout_s=job.launch.timeout_s)
    trainer, start = train._prepare(job, dims, Path(job.output_dir), None, [])
    device = trainer.engine.device
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if device.type == "cuda" and not tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows = StepRows(device, trainer.tokens_per_step)
    syncs, sites = [], Counter()
    for step in range(start + 1, start + steps + 1):
        with SyncCounter(device) if count_syncs else contextlib.nullcontext() as counter:
            rows.add(trainer.train_step(step))
        if count_syncs:
            syncs.append(counter.count)
            sites.update({f"step {step} {site}": n for site, n in counter.sites.items()})
    finished = rows.close()
    out = {
        "mixed_precision": pc.mixed_precision,
        "tf32_matmuls": bool(device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32),
        "loss": [r["loss"] for r in finished],
        "grad_norm": [r["grad_norm"] for r in finished],
    }
    if count_syncs:
        out["syncs_per_step"] = syncs if device.type == "cuda" else NOT_APPLICABLE
        out["sync_sites"] = dict(sites)
    del trainer, rows
    gc.collect()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def loss_parity(test: list[float], reference: list[float], rtol: float) -> dict:
    """Per step ``|test - reference|`` and that over ``|reference|``; ``ok`` when every relative
    difference is within ``rtol``."""
    rel = [abs(a - b) / abs(b) if b else math.inf for a, b in zip(test, reference)]
    return {
        "steps": len(rel),
        "abs": [abs(a - b) for a, b in zip(test, reference)],
        "rel": rel,
        "max_rel": max(rel),
        "rtol": rtol,
        "ok": max(rel) <= rtol,
    }
