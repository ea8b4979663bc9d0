"""The child side of ``consolidate.py``: what each measured subprocess runs (ours, DCP's
``dcp_to_torch_save``, the all-in-RAM merge, the idle floor, the synthetic builds) and the
verification of every output against its pieces. ``consolidate.py --child KIND SPEC`` lands in
``child_main`` here."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from bench_util import proc_status
from synthetic_checkpoint import (
    build_checkpoint,
    build_dcp,
    itemsize,
    make_piece,
    numel,
    split_dim,
)

MiB = 1 << 20
SPOT_CHECK = 6  # tensors compared element for element in each output


# --------------------------------------------------------------------------------------------
# What each measured child runs


def run_ours(ckpt: Path, out: Path, profile: bool) -> dict:
    from neuron_parallel.checkpoint import export as xmod
    from neuron_parallel.checkpoint import export_checkpoint

    # Time the up-front checks apart from the copying (wrapper calls; nothing else changes): the
    # quick validation, the headers, and the sha256 of the config files.
    timing = {"validate_s": 0.0}
    real_open_source = xmod.open_source

    def open_source(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_open_source(*a, **k)
        finally:
            timing["validate_s"] += time.perf_counter() - t0

    xmod.open_source = open_source
    if not profile:
        t0, c0 = time.perf_counter(), time.process_time()
        export_checkpoint(ckpt, out)
        return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, **timing}
    import cProfile
    import io
    import pstats

    phases = _instrument_ours()
    prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    export_checkpoint(ckpt, out)
    prof.disable()
    t = time.perf_counter() - t0
    phases["process_cpu_s"] = time.process_time() - c0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    phases["validate_s"] = timing["validate_s"]
    phases["fsync_s"] = phases["threads"]["fsync_s"]
    phases["other_s"] = t - phases["validate_s"] - phases["pass_wall_s"] - phases["fsync_s"]
    return {"seconds": t, "cprofile_tottime_top": buf.getvalue(), "phases": phases, **timing}


class _Clock:
    """Seconds spent in each kind of call, summed over threads: wall, and on-CPU (the calling
    thread's CPU time, which other people's load on a shared machine inflates far less); and the
    largest RSS seen."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        keys = ("read", "hash", "write_rows", "write_box", "fsync")
        self.s = {f"{k}_s": 0.0 for k in keys}
        self.cpu = {f"{k}_s": 0.0 for k in keys}
        self.max_rss = {"rss_anon_mib": 0.0, "rss_file_mib": 0.0}

    def timed(self, key: str, fn, sample: bool = False):
        def call(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                with self.lock:
                    self.s[key] += dt
                    self.cpu[key] += dc
                    if sample:
                        st = proc_status(os.getpid())
                        for name, field in (("rss_anon_mib", "RssAnon"), ("rss_file_mib", "RssFile")):
                            self.max_rss[name] = max(self.max_rss[name], st.get(field, 0) / 1024)

        return call


def _instrument_ours() -> dict:
    """Wrap (in this child only) the one-pass writer's reads, hashing, writes and fsyncs to time
    them, summed over its threads, and sample RSS at every write; cProfile sees the main thread
    only, which waits while the threads work. The library files are not changed."""
    import builtins
    import hashlib
    import types

    from neuron_parallel.checkpoint import consolidate as cmod
    from neuron_parallel.checkpoint import hf_dir as wmod
    from neuron_parallel.checkpoint import scatter as smod

    clock = _Clock()
    phases: dict = {"pass_wall_s": 0.0}

    class _File:
        def __init__(self, f):
            self._f = f
            self.readinto = clock.timed("read_s", f.readinto)

        def __getattr__(self, k):
            return getattr(self._f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self._f.__exit__(*a)

    class _Hash:
        def __init__(self):
            self._h = hashlib.sha256()
            self.update = clock.timed("hash_s", self._h.update)

        def hexdigest(self):
            return self._h.hexdigest()

    smod.open = lambda *a, **k: _File(builtins.open(*a, **k))  # a module global shadows the builtin
    smod.hashlib = types.SimpleNamespace(sha256=_Hash)
    smod.write_behind = clock.timed("write_rows_s", smod.write_behind, sample=True)
    real_box = smod.box_writer
    smod.box_writer = lambda *a: clock.timed("write_box_s", real_box(*a), sample=True)
    real_scatter = smod.scatter_pieces

    def scatter_pieces(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_scatter(*a, **k)
        finally:
            phases["pass_wall_s"] += time.perf_counter() - t0

    cmod.scatter_pieces = scatter_pieces
    proxy = types.ModuleType("os")
    proxy.__dict__.update(os.__dict__)
    proxy.fsync = clock.timed("fsync_s", os.fsync)
    wmod.os = proxy
    phases["threads"] = clock.s  # filled in as the run goes
    phases["threads_cpu"] = clock.cpu
    phases["max_rss_at_writes"] = clock.max_rss
    return phases


def run_dcp(dcp_dir: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dcp_to_torch_save(dcp_dir, out / "model.pt")
    return {"seconds": time.perf_counter() - t0}


def run_allram(ckpt: Path, out: Path) -> dict:
    """optimum-neuron-style consolidation: per pp stage, load every tp shard fully, cat the pieces,
    keep the merged tensors; save the merged state in one go at the end."""
    import torch
    from safetensors.torch import load_file, save_file

    from neuron_parallel.checkpoint.format import Manifest, model_file

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    manifest = Manifest.load(ckpt)
    pp_size = manifest.parallel["pp"]
    tp_size = manifest.parallel["tp"]
    merged: dict[str, torch.Tensor] = {}
    for pp in range(pp_size):
        shards = [load_file(str(ckpt / model_file(tp, pp))) for tp in range(tp_size)]
        for name in shards[0]:
            parts = [s[name] for s in shards if name in s]
            d = split_dim(name)
            merged[name] = parts[0] if d is None or len(parts) == 1 else torch.cat(parts, dim=d)
        del shards, parts
    save_file(dict(sorted(merged.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    return {"seconds": time.perf_counter() - t0}


def run_idle() -> dict:
    """Interpreter + the imports the runs share: the RSS floor under every Python measurement."""
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import neuron_parallel.checkpoint  # noqa: F401

    return {"seconds": 0.0}


def child_main(argv: list[str]) -> None:
    kind, spec = argv[0], json.loads(argv[1])
    if kind == "ours":
        res = run_ours(Path(spec["ckpt"]), Path(spec["out"]), spec.get("profile", False))
    elif kind == "dcp":
        res = run_dcp(Path(spec["dcp"]), Path(spec["out"]))
    elif kind == "allram":
        res = run_allram(Path(spec["ckpt"]), Path(spec["out"]))
    elif kind == "idle":
        res = run_idle()
    elif kind == "build":
        res = build_checkpoint(Path(spec["run"]), spec["size_bytes"], spec["dtype"])
    elif kind == "build_dcp":
        build_dcp(Path(spec["ckpt"]), Path(spec["dcp"]))
        res = {}
    elif kind == "verify":
        res = verify(spec)
    else:
        raise SystemExit(f"unknown child kind {kind}")
    res["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    Path(spec["result"]).write_text(json.dumps(res))


# --------------------------------------------------------------------------------------------
# Verification (in a child too, so the parent never holds tensors)


def verify(spec: dict) -> dict:
    """Compare an output with the pieces: every name present, byte total, spot-checked values."""
    import torch
    from safetensors import safe_open

    from neuron_parallel.checkpoint.format import Manifest

    ckpt = Path(spec["ckpt"])
    manifest = Manifest.load(ckpt)
    names = [n for n, t in manifest.tensors.items() if t.kind == "model"]
    expected_bytes = sum(numel(manifest.tensors[n].shape) for n in names) * itemsize(manifest.tensors[names[0]].dtype)
    # the largest tensor, a row-split, a column-split (both stages) and a replicated one
    by_size = sorted(names, key=lambda n: -numel(manifest.tensors[n].shape))
    picks = [by_size[0]]
    for needle in (
        "layers.0.self_attn.q_proj",
        "layers.0.self_attn.o_proj",
        "mlp.down_proj",
        "post_attention_layernorm",
        "lm_head",
    ):
        hits = [n for n in names if needle in n and n not in picks]
        if hits:
            picks.append(hits[-1])
    picks = picks[:SPOT_CHECK]

    path = Path(spec["path"])
    problems: list[str] = []
    if path.suffix == ".pt":
        sd = torch.load(path, mmap=True, weights_only=True)
        keys = set(sd)
        get = sd.__getitem__
        payload = sum(t.numel() * t.element_size() for t in sd.values())
        file_bytes = path.stat().st_size
    else:
        f = safe_open(str(path), framework="pt")
        keys = set(f.keys())
        get = f.get_tensor
        payload = sum(numel(f.get_slice(k).get_shape()) for k in keys) * itemsize(manifest.tensors[names[0]].dtype)
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
        file_bytes = path.stat().st_size
        if file_bytes != 8 + header_len + expected_bytes:
            problems.append(f"file is {file_bytes} bytes, expected 8 + {header_len} + {expected_bytes}")
    if keys != set(names):
        problems.append(f"names differ: missing {sorted(set(names) - keys)[:5]}, extra {sorted(keys - set(names))[:5]}")
    if payload != expected_bytes:
        problems.append(f"tensor payload {payload} bytes, expected {expected_bytes}")
    checked = []
    dtype = getattr(torch, manifest.tensors[names[0]].dtype)
    for name in picks:
        entry = manifest.tensors[name]
        ref = torch.empty(entry.shape, dtype=dtype)
        for p in entry.pieces:
            tp = int(p.file.split("tp_rank_")[1][:2])
            idx = tuple(slice(o, o + n) for o, n in zip(p.offsets, p.shape))
            ref[idx] = make_piece(name, tp, p.shape, dtype)  # rebuilt from its seed, not read back
        got = get(name)
        ok = list(got.shape) == entry.shape and got.dtype == dtype and torch.equal(got, ref)
        checked.append({"name": name, "shape": entry.shape, "pieces": len(entry.pieces), "equal": bool(ok)})
        if not ok:
            problems.append(f"{name} differs from its pieces")
    return {
        "ok": not problems,
        "problems": problems,
        "file_bytes": file_bytes,
        "payload_bytes": payload,
        "expected_payload_bytes": expected_bytes,
        "spot_checked": checked,
    }
