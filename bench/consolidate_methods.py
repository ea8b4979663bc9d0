"""The child side of ``consolidate.py``: what each measured subprocess runs (ours, DCP's
``dcp_to_torch_save``, the all-in-RAM merge, the idle floor, the synthetic builds) and the
verification of every output against its pieces, plus the ``/proc/<pid>/status`` reader that both
the children and the parent's RSS poller use. ``consolidate.py --child KIND SPEC`` lands in
``child_main`` here."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from synthetic_checkpoint import (  # bench/ is on sys.path (the running script's folder)
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
# /proc/<pid>/status


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0])  # kB
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


# --------------------------------------------------------------------------------------------
# What each measured child runs


def run_ours(ckpt: Path, out: Path, profile: bool) -> dict:
    from neuron_parallel.checkpoint import consolidate as cmod
    from neuron_parallel.checkpoint import consolidate_checkpoint

    # Time the up-front validation apart from the streaming (a wrapper call; nothing else changes).
    timing = {"validate_s": 0.0}
    real_validate = cmod.validate_checkpoint

    def validate(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_validate(*a, **k)
        finally:
            timing["validate_s"] += time.perf_counter() - t0

    cmod.validate_checkpoint = validate
    extra: dict = {}
    if profile:
        extra = _instrument_ours()
        import cProfile
        import pstats

        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        consolidate_checkpoint(ckpt, out)
        prof.disable()
        t = time.perf_counter() - t0
        import io

        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        extra["cprofile_tottime_top"] = buf.getvalue()
        extra.update(timing)
        ph = extra["phases"] = extra.pop("_phases")
        ph["tobytes_s"] = sum(v[2] for k, v in pstats.Stats(prof).stats.items() if "tobytes" in k[2])
        ph["validate_s"] = timing["validate_s"]
        ph["other_s"] = t - sum(ph[k] for k in ("read_s", "write_s", "fsync_s", "tobytes_s", "validate_s"))
        return {"seconds": t, **extra}
    t0 = time.perf_counter()
    consolidate_checkpoint(ckpt, out)
    return {"seconds": time.perf_counter() - t0, **timing}


def _instrument_ours() -> dict:
    """Wrap (in this child only) the library's read / write / fsync steps to time them and sample
    RSS, so a missed goal can be traced to a phase. The library files are not changed."""
    import builtins
    import types

    from neuron_parallel.checkpoint import consolidate as cmod
    from neuron_parallel.checkpoint import tensors as tmod

    phases = {"read_s": 0.0, "write_s": 0.0, "fsync_s": 0.0, "per_tensor": []}
    orig_read = tmod.CheckpointTensors.read

    def _rss() -> dict:
        st = proc_status(os.getpid())
        return {"rss_anon_mib": st.get("RssAnon", 0) / 1024, "rss_file_mib": st.get("RssFile", 0) / 1024}

    def read(self, name, offsets=None, shape=None):
        t0 = time.perf_counter()
        out = orig_read(self, name, offsets, shape)
        dt = time.perf_counter() - t0
        phases["read_s"] += dt
        phases["per_tensor"].append(
            {"name": name, "mib": out.numel() * out.element_size() / MiB, "read_s": dt, "after_read": _rss()}
        )
        return out

    tmod.CheckpointTensors.read = read

    class _Timed:
        """The output file, with write() timed and RSS sampled as the bytes arrive."""

        def __init__(self, f):
            self._f = f

        def write(self, b):
            if len(b) > 4096 and phases["per_tensor"]:
                phases["per_tensor"][-1]["at_write"] = _rss()
            t0 = time.perf_counter()
            n = self._f.write(b)
            phases["write_s"] += time.perf_counter() - t0
            return n

        def __getattr__(self, k):
            return getattr(self._f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self._f.__exit__(*a)

    def timed_open(path, mode="r", *a, **k):
        f = builtins.open(path, mode, *a, **k)
        return _Timed(f) if "w" in mode and str(path).endswith(".safetensors.tmp") else f

    cmod.open = timed_open  # a module global shadows the builtin inside consolidate.py

    def fsync(fd):
        t0 = time.perf_counter()
        os.fsync(fd)
        phases["fsync_s"] += time.perf_counter() - t0

    proxy = types.ModuleType("os")
    proxy.__dict__.update(os.__dict__)
    proxy.fsync = fsync
    cmod.os = proxy
    return {"_phases": phases}


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
