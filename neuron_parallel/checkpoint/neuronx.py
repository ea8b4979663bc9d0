"""Read optimum-neuron / neuronx-distributed training checkpoints, one Hugging Face tensor at a time.

Layouts (``shards`` is the folder the trainer names; ``tensor_parallel_shards`` is also accepted):

```
(a) neuronx_distributed.trainer.save_checkpoint, as optimum-neuron 0.4.x calls it
  shards/model/dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt    rank-local flat state dict
  shards/model/<that>.pt.tensors/tensor_{id}.pt                   with xser: one tensor per file,
  shards/model/<that>.pt.info.pt                                  the .pt holds references
  shards/mp_metadata_pp_rank_{pp}.json                            partitioning + transformation
                                                                  specs (older: ..._{pp}.pt)
  shards/done                                                     written last
  shards/optim/..., shards/checkpoint, scheduler.pt, ...          ignored here
(b) neuronx_distributed.parallel_layers.save (older optimum-neuron)
  shards/tp_rank_{tp:02d}_pp_rank_{pp:02d}/checkpoint.pt          {"model": state dict,
  shards/tp_rank_{tp:02d}_pp_rank_{pp:02d}  (+ .tensors/)          "sharded_metadata": ...,
                                                                   "gqa_qkv_metadata": ...}; xser
```

Every pickle is loaded with ``weights_only=True``; the only class allowed beyond torch's own is a
stand-in for xser's ``TensorReference`` (an integer id). Rank files are memory-mapped, so a
tensor's bytes are read only when a Hugging Face tensor needs them, and each Hugging Face tensor
is assembled straight into its output buffer from the pieces of it each rank holds: memory stays
near the largest tensor. The inverse transformations (unfusing ``qkv_proj``/``gate_up_proj``,
keeping one copy of K/V replicated ``kv_size_multiplier`` times, undoing the query-head
permutation of the GQA QKV layer) follow the metadata the trainer wrote.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..utils import read_json
from .format import HF_FILES, confined, user_model_files
from .neuronx_layout import (
    _GQA,
    _METADATA,
    DONE,
    _find_config,
    _Fused,
    _load,
    _locate_files,
    _Param,
    _RankFile,
    _Stage,
    _vocab_trimmed,
    query_head_order,
)
from .shapes import expected_shapes

_Entry = tuple[str, list[int], torch.dtype, Callable[[], torch.Tensor]]
MAX_TP = 4096
"""The largest tensor-parallel degree (``num_partitions``) a checkpoint's metadata may record."""


def _first_missing(present, tp: int, pp: int, limit: int):
    """The first ``limit`` (tp_rank, pp_rank) of the tp × pp grid not in ``present``, found
    without walking more than ``len(present) + limit`` cells."""
    found = 0
    for t in range(tp):
        for p in range(pp):
            if (t, p) not in present:
                yield t, p
                found += 1
                if found == limit:
                    return


class NeuronxCheckpoint:
    """An optimum-neuron / neuronx-distributed checkpoint as a ``TensorSource`` for the
    streaming writer in ``hf_dir.py``. Construction validates (done marker, every rank file
    of the tp × pp grid, metadata, xser tensor files, shapes against the model config) and
    raises ``ValueError`` naming every problem found."""

    def __init__(self, shards: str | Path, *, model_dir: str | Path | None = None) -> None:
        self.shards = Path(shards)
        self.ckpt_dir = self.shards.parent
        self._problems: list[str] = []
        files_dir, problem = _find_config(self.ckpt_dir, model_dir)
        self._files_dir = files_dir
        self._users_dir = model_dir is not None
        self.model_config: dict[str, Any] = read_json(files_dir / "config.json") if files_dir else {}
        if problem:
            self._problems.append(problem)
        self.layout, self.xser, files = _locate_files(self.shards)
        metadata = self._read_metadata() if self.layout == "trainer" else {}
        self.tp, self.pp = self._check_grid(files, metadata)
        self._refuse_if_any()
        self.stages = [
            self._build_stage(p, [files[t, p] for t in range(self.tp)], metadata.get(p)) for p in range(self.pp)
        ]
        self._refuse_if_any()
        self._entries = self._plan_all()
        self._refuse_if_any()

    # -- TensorSource ---------------------------------------------------------------------------
    def plan(self) -> list[tuple[str, list[int], torch.dtype]]:
        return [(name, shape, dtype) for name, shape, dtype, _ in self._entries.values()]

    def read(self, name: str) -> torch.Tensor:
        return self._entries[name][3]()

    def hf_files(self) -> list[Path]:
        d = self._files_dir
        if d is None:
            return []
        if self._users_dir:  # the user's own model directory
            return user_model_files(d)
        return [p for n in HF_FILES if (p := confined(d, n, f"{d}: model file")).is_file()]

    # -- validation -----------------------------------------------------------------------------
    def _refuse_if_any(self) -> None:
        if self._problems:
            raise ValueError(f"refusing to consolidate {self.ckpt_dir}: " + "; ".join(self._problems))

    def _read_metadata(self) -> dict[int, Any]:
        if not (self.shards / DONE).is_file():
            self._problems.append(
                f"{self.shards / DONE}: missing (neuronx-distributed writes it once every rank has saved; "
                "the save did not finish)"
            )
        found: dict[int, Path] = {}
        for p in sorted(self.shards.iterdir()):
            m = _METADATA.match(p.name)
            if m and (int(m.group(1)) not in found or m.group(2) == "json"):
                found[int(m.group(1))] = p
        self._metadata_files = found
        metadata = {}
        for pp_rank, path in found.items():
            try:
                confined(self.shards, path.name, f"{self.shards}: metadata file")
                metadata[pp_rank] = read_json(path) if path.suffix == ".json" else _load(path, mmap=False)
            except Exception as e:  # a damaged file is a finding, not a crash
                self._problems.append(f"{path}: unreadable ({e})")
        return metadata

    def _check_grid(self, files: dict[tuple[int, int], Path], metadata: dict[int, Any]) -> tuple[int, int]:
        if not files:
            where = self.shards / "model" if self.layout == "trainer" else self.shards
            self._problems.append(
                f"{where}: no rank files (dp_rank_00_tp_rank_XX_pp_rank_YY.pt or tp_rank_XX_pp_rank_YY/)"
            )
            return 0, 0
        tp = max(t for t, _ in files) + 1
        pp = max([p for _, p in files] + [p for p in metadata]) + 1
        recorded = self._recorded_tp(metadata, tp)
        if recorded is not None and recorded < tp:
            self._problems.append(
                f"{self._rank_path(tp - 1, 0)}: tp_rank {tp - 1} exists, but the metadata records "
                f"num_partitions={recorded} (tp ranks 0..{recorded - 1})"
            )
        elif recorded is not None:  # the tp degree the trainer recorded beats counting files
            tp = recorded
        # Rank numbers come from file names and metadata: list the first few holes and count the
        # rest, so that pp_rank_999999999 or num_partitions=4096 costs nothing.
        for t, p in list(_first_missing(files, tp, pp, 3)):
            self._problems.append(f"{self._rank_path(t, p)}: missing (tp_rank {t}, pp_rank {p} of tp={tp}, pp={pp})")
        if tp * pp - len(files) > 3:
            self._problems.append(f"{tp * pp - len(files) - 3} more rank files of the tp={tp} × pp={pp} grid missing")
        if self.layout == "trainer":
            for _, p in list(_first_missing({(0, p) for p in self._metadata_files}, 1, pp, 3)):
                path = self.shards / f"mp_metadata_pp_rank_{p}.json"
                self._problems.append(f"{path}: missing (the partitioning of pp_rank {p})")
            if pp - len(self._metadata_files) > 3:
                self._problems.append(f"{pp - len(self._metadata_files) - 3} more mp_metadata files missing")
        return tp, pp

    def _recorded_tp(self, metadata: dict[int, Any], counted: int) -> int | None:
        """The ``num_partitions`` the metadata records for its tensor-parallel parameters: one
        positive integer, at most ``MAX_TP`` (the number of rank files is checked against it);
        None, with the problem noted, when the records disagree or make no sense."""
        values = set()
        for pp_rank, meta in metadata.items():
            for name, param in (meta.get("parameters") or {}).items() if isinstance(meta, dict) else ():
                if not isinstance(param, dict) or not param.get("tensor_model_parallel"):
                    continue
                n = param.get("num_partitions")
                if type(n) is not int or not 1 <= n <= MAX_TP:
                    self._problems.append(
                        f"{self._metadata_files[pp_rank]}: {name} records num_partitions={n!r}; a tensor-parallel "
                        f"degree is an integer from 1 to {MAX_TP} (the rank files say tp={counted})"
                    )
                    return None
                values.add(n)
        if len(values) > 1:
            self._problems.append(
                f"{self.shards}: the metadata records num_partitions {sorted(values)}; one tensor-parallel "
                f"degree is expected (the rank files say tp={counted})"
            )
            return None
        return values.pop() if values else None

    def _rank_path(self, tp_rank: int, pp_rank: int) -> Path:
        if self.layout == "trainer":
            return self.shards / "model" / f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"
        name = f"tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}"
        return self.shards / name if self.xser else self.shards / name / "checkpoint.pt"

    def _build_stage(self, pp_rank: int, paths: list[Path], metadata: Any) -> _Stage:
        ranks = []
        for path in paths:
            try:
                ranks.append(_RankFile(path, xser=self.xser, legacy=self.layout == "legacy"))
            except Exception as e:  # a damaged or foreign pickle is a finding, not a crash
                self._problems.append(f"{path}: unreadable ({e})")
        stage = _Stage(pp_rank, ranks)
        if len(ranks) < len(paths):
            return stage
        for r in ranks:
            missing = r.missing_tensor_files()
            if missing:
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                self._problems.append(
                    ", ".join(str(m) for m in missing[:3]) + f"{more}: missing (xser tensors of {r.path})"
                )
        keys = ranks[0].keys()
        for r in ranks[1:]:
            if set(r.keys()) != set(keys):
                diff = sorted(set(keys) ^ set(r.keys()))
                self._problems.append(f"{r.path}: holds other tensors than {ranks[0].path} ({', '.join(diff[:4])})")
        if self.layout == "trainer" and isinstance(metadata, dict) and "parameters" in metadata:
            self._stage_from_specs(stage, metadata)
        else:
            old = metadata if self.layout == "trainer" else ranks[0].extra
            self._stage_from_old_metadata(stage, old if isinstance(old, dict) else {})
        return stage

    # -- metadata → partitioning ------------------------------------------------------------------
    def _stage_from_specs(self, stage: _Stage, meta: dict) -> None:
        """optimum-neuron ≥ 0.1: per-parameter partitioning plus transformation specs."""
        for name, m in meta["parameters"].items():
            if m.get("tensor_model_parallel"):
                stride = m.get("partition_stride") or 1
                if type(stride) is not int or stride < 1:
                    self._problems.append(f"{name}: partition_stride={stride!r} is not a positive integer")
                    continue
                stage.params[name] = _Param(True, int(m["partition_dim"]), stride)
        for group in meta.get("model_weight_transformation_specs") or []:
            prefix = group["module_fully_qualified_name"]
            for cls_name, spec in group["specs"]:
                if spec.get("peft_type"):
                    self._problems.append(f"{prefix}: {spec['peft_type']} adapter weights are not supported")
                    continue
                if spec.get("tp_size", self.tp) != self.tp:
                    self._problems.append(
                        f"{prefix}: {cls_name} recorded tp_size={spec['tp_size']}, the rank files say tp={self.tp}"
                    )
                    continue
                params = ["weight", "bias"] if spec.get("bias") else ["weight"]
                if cls_name == "FusedLinearsSpec":
                    axis = {"column": 0, "row": 1}.get(spec["fuse_axis"], spec["fuse_axis"])
                    for param in params:
                        stage.fused.append(
                            _Fused(
                                key=f"{prefix}.{spec['fused_linear_name']}.{param}",
                                outputs=[f"{prefix}.{n}.{param}" for n in spec["linear_names"]],
                                dims=[int(d) for d in spec["original_dims"]],
                                axis=0 if param == "bias" else int(axis),
                                tp=self.tp,
                            )
                        )
                elif cls_name == "GQAQKVColumnParallelLinearSpec":
                    qkv = f"{prefix}.{spec['gqa_qkv_projection_name']}"
                    for param in params:
                        sources = (
                            (f"{qkv}.{param}_qkv",) if spec["fuse_qkv"] else tuple(f"{qkv}.{param}_{s}" for s in "qkv")
                        )
                        stage.gqa.append(
                            _GQA(
                                sources=sources,
                                q=f"{prefix}.{spec['query_projection_name']}.{param}",
                                k=f"{prefix}.{spec['key_projection_name']}.{param}",
                                v=f"{prefix}.{spec['value_projection_name']}.{param}",
                                o=f"{prefix}.{spec['output_projection_name']}.weight" if param == "weight" else None,
                                num_heads=int(spec["num_attention_heads"]),
                                num_kv_heads=int(spec["num_key_value_heads"]),
                                kv_mult=int(spec["kv_size_multiplier"]),
                                q_rows=spec.get("q_output_size_per_partition"),
                                kv_rows=spec.get("kv_output_size_per_partition"),
                                permuted=True,
                                tp=self.tp,
                            )
                        )
                else:
                    self._problems.append(f"{prefix}: transformation {cls_name} is not supported")

    def _stage_from_old_metadata(self, stage: _Stage, meta: dict) -> None:
        """Older optimum-neuron: ``sharded_metadata`` ({name: {kind, partition_dim}}) and
        ``gqa_qkv_metadata`` (GQA names, head counts, kv_size_multiplier; the Q permutation came
        in with ``output_projections_names``)."""
        if "sharded_metadata" not in meta:
            where = stage.ranks[0].path if self.layout == "legacy" else self._metadata_files[stage.pp_rank]
            self._problems.append(f"{where}: no partitioning metadata (sharded_metadata / parameters)")
            return
        for name, m in meta["sharded_metadata"].items():
            if m.get("kind") == "sharded":
                stage.params[name] = _Param(True, int(m["partition_dim"]))
        gqa = meta.get("gqa_qkv_metadata") or {}
        mapping = gqa.get("original_names_to_gqa_qkv_names") or {}
        targets: dict[str, dict[str, str]] = {}  # gqa parameter (without _q/_k/_v) → role → original name
        for orig, target in mapping.items():
            base, _, suffix = target.rpartition("_")
            if suffix == "qkv":
                roles = targets.setdefault(target, {})
                roles["qkv"[len(roles)]] = orig  # q, k, v in the order the mapping lists them
            else:
                targets.setdefault(base, {})[suffix] = orig
        outputs = set(gqa.get("output_projections_names") or ())
        for base, roles in targets.items():
            if set(roles) != set("qkv"):
                self._problems.append(f"{base}: GQA metadata lacks one of q/k/v ({sorted(roles)})")
                continue
            prefix = roles["q"].rsplit(".", 2)[0] + "."
            o = next((n for n in sorted(outputs) if n.startswith(prefix) and n.endswith(".weight")), None)
            fused = base in mapping.values()
            stage.gqa.append(
                _GQA(
                    sources=(base,) if fused else tuple(f"{base}_{s}" for s in "qkv"),
                    q=roles["q"],
                    k=roles["k"],
                    v=roles["v"],
                    o=o if roles["q"].endswith(".weight") else None,
                    num_heads=int(gqa["num_attention_heads"]),
                    num_kv_heads=int(gqa["num_key_value_heads"]),
                    kv_mult=int(gqa.get("kv_size_multiplier") or 1),
                    q_rows=gqa.get("q_output_size_per_partition"),
                    kv_rows=gqa.get("kv_output_size_per_partition"),
                    permuted="output_projections_names" in gqa,
                    tp=self.tp,
                )
            )

    # -- planning: one entry (shape, dtype, reader) per Hugging Face tensor ------------------------
    def _plan_all(self) -> dict[str, _Entry]:
        entries: dict[str, _Entry] = {}
        for stage in self.stages:
            for entry in self._stage_entries(stage):
                entries.setdefault(entry[0], entry)  # a weight shared by two stages is written once
        if self.model_config.get("tie_word_embeddings"):
            entries.pop("lm_head.weight", None)
        if self._problems:  # refused as it stands: no need to build the model to compare
            return entries
        try:
            expected = expected_shapes(self.model_config) if self.model_config else None
        except Exception:  # an architecture transformers does not know: nothing to compare with
            expected = None
        if expected is not None:
            missing = [n for n in expected if n not in entries]
            if missing:
                self._problems.append(
                    f"{len(missing)} tensors of the model in config.json are in no rank file "
                    f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); "
                    "a pipeline stage or rank is missing"
                )
            for name, (_, shape, _, _) in entries.items():
                if name in expected and expected[name] != shape:
                    self._problems.append(f"{name}: consolidates to {shape}, config.json says {expected[name]}")
        return entries

    def _stage_entries(self, stage: _Stage) -> list[_Entry]:
        keys = stage.ranks[0].keys()
        present = set(keys)
        by_key: dict[str, list[_Entry]] = {}
        consumed: set[str] = set()
        for f in stage.fused:
            if f.key in present:
                by_key[f.key] = self._fused_entries(stage, f)
                consumed.add(f.key)
        for g in stage.gqa:
            have = [s for s in g.sources if s in present]
            if have and len(have) < len(g.sources):
                self._problems.append(f"{stage.ranks[0].path}: holds {have} but not all of {list(g.sources)}")
            if len(have) < len(g.sources):
                continue
            by_key[g.sources[0]] = self._gqa_entries(stage, g)
            consumed.update(g.sources)
            if by_key[g.sources[0]] and g.permuted and g.o is not None and g.o in present:
                by_key[g.o] = [self._output_entry(stage, g)]
                consumed.add(g.o)
        out: list[_Entry] = []
        for key in keys:
            if key in by_key:
                out += by_key[key]
            elif key not in consumed:
                out.append(self._plain_entry(stage, key))
        return out

    def _local(self, stage: _Stage, key: str) -> tuple[list[int], torch.dtype]:
        shape, dtype = stage.ranks[0].meta(key)
        for r in stage.ranks[1:]:
            if r.meta(key) != (shape, dtype):
                self._problems.append(
                    f"{r.path}: {key} is {r.meta(key)[0]} {r.meta(key)[1]}, tp_rank 0 has {shape} {dtype}"
                )
        return list(shape), dtype

    def _plain_entry(self, stage: _Stage, key: str) -> _Entry:
        p = stage.params.get(key, _Param())
        shape, dtype = self._local(stage, key)
        if p.parallel and not 0 <= p.dim < len(shape):
            self._problems.append(f"{key}: partition_dim={p.dim}, but the tensor has {len(shape)} dims ({shape})")
            return key, shape, dtype, self._refuse_if_any
        if p.parallel and shape[p.dim] % p.stride:
            self._problems.append(
                f"{key}: partition_stride={p.stride} does not divide dim {p.dim} of the rank's piece {shape}; "
                "the blocks the ranks interleave would not tile the tensor"
            )
            return key, shape, dtype, self._refuse_if_any
        if p.parallel:
            shape[p.dim] *= self.tp
        shape = _vocab_trimmed(key, shape, self.model_config)
        dim = p.dim if p.parallel else None
        return key, shape, dtype, lambda: self._gather(stage, key, shape, dtype, dim, stride=p.stride)

    def _fused_entries(self, stage: _Stage, f: _Fused) -> list[_Entry]:
        local, dtype = self._local(stage, f.key)
        if local[f.axis] * f.tp != sum(f.dims) or any(d % f.tp for d in f.dims):
            self._problems.append(
                f"{f.key}: fused dim {f.axis} is {local[f.axis]} per rank, metadata says {f.dims} over tp={f.tp}"
            )
            return []
        p = stage.params.get(f.key)
        dim = p.dim if p is not None and p.parallel else f.axis
        entries, start = [], 0
        for name, d in zip(f.outputs, f.dims):
            shape = list(local)
            shape[f.axis] = d // f.tp
            shape[dim] *= f.tp
            narrow = (f.axis, start, d // f.tp)
            entries.append(
                (
                    name,
                    shape,
                    dtype,
                    lambda key=f.key, shape=shape, narrow=narrow: self._gather(
                        stage, key, shape, dtype, dim, narrow=narrow
                    ),
                )
            )
            start += d // f.tp
        return entries

    def _gqa_entries(self, stage: _Stage, g: _GQA) -> list[_Entry]:
        tp, heads, kv_heads, mult = g.tp, g.num_heads, g.num_kv_heads, g.kv_mult
        orders = self._head_orders(g) if g.permuted else None
        if g.permuted and orders is None:
            return []
        if len(g.sources) == 1:  # fused: [q; k; v] rows per rank
            local, dtype = self._local(stage, g.sources[0])
            rows = local[0]
            q_rows, kv_rows = g.q_rows, g.kv_rows
            if q_rows is None or kv_rows is None:  # older metadata: derive from the head counts
                head_dim = rows * tp // (heads + 2 * kv_heads * mult)
                q_rows, kv_rows = heads // tp * head_dim, kv_heads * mult // tp * head_dim
            if q_rows + 2 * kv_rows != rows:
                self._problems.append(f"{g.sources[0]}: {rows} rows per rank, metadata says {q_rows} + 2 × {kv_rows}")
                return []
            key = g.sources[0]
            cuts = ((0, q_rows), (q_rows, kv_rows), (q_rows + kv_rows, kv_rows))
            parts = [(key, local, dtype, (0, start, n)) for start, n in cuts]
        else:
            parts = [(key, *self._local(stage, key), None) for key in g.sources]
        entries = []
        for role, (name, (key, local, dtype, narrow)) in enumerate(zip((g.q, g.k, g.v), parts)):
            rows = narrow[2] if narrow else local[0]
            shape = [rows * tp, *local[1:]]
            if role:  # K/V: the ranks hold kv_mult copies one after the other; keep the first
                if shape[0] % mult:
                    self._problems.append(
                        f"{key}: {shape[0]} K/V rows do not split into kv_size_multiplier={mult} copies"
                    )
                    return []
                shape[0] //= mult
            if role == 0 and g.permuted:
                reader = functools.partial(self._gather_heads, stage, key, shape, dtype, 0, heads, orders, narrow)
            else:
                reader = functools.partial(self._gather, stage, key, shape, dtype, 0, narrow=narrow)
            entries.append((name, shape, dtype, reader))
        return entries

    def _head_orders(self, g: _GQA) -> list[torch.Tensor] | None:
        try:
            orders = [query_head_order(g.tp, r, g.num_heads, g.num_kv_heads, g.kv_mult) for r in range(g.tp)]
            if torch.equal(torch.cat(orders).sort().values, torch.arange(g.num_heads)):
                return orders
        except (ZeroDivisionError, IndexError, RuntimeError):
            pass
        self._problems.append(
            f"{g.q}: GQA layout num_heads={g.num_heads} num_kv_heads={g.num_kv_heads} "
            f"kv_size_multiplier={g.kv_mult} tp={g.tp} is not one this reader can undo"
        )
        return None

    def _output_entry(self, stage: _Stage, g: _GQA) -> _Entry:
        p = stage.params.get(g.o)
        dim = p.dim if p is not None and p.parallel else 1  # a RowParallelLinear: split over its input
        shape, dtype = self._local(stage, g.o)
        shape[dim] *= g.tp
        orders = self._head_orders(g)
        return g.o, shape, dtype, lambda: self._gather_heads(stage, g.o, shape, dtype, dim, g.num_heads, orders)

    # -- reading: each rank's piece copied straight into the output ----------------------------------
    def _gather(
        self,
        stage: _Stage,
        key: str,
        shape: list[int],
        dtype: torch.dtype,
        dim: int | None,
        *,
        stride: int = 1,
        narrow: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        """Concatenate the ranks' pieces of ``key`` along ``dim`` (None: replicated, rank 0's);
        ``narrow`` cuts each piece first; with ``stride`` s each piece is s blocks, block j of
        rank r landing at position j·tp + r; whatever falls outside ``shape`` is skipped. Every
        element of the result is written, or ``ValueError``: no uninitialised memory leaves."""
        out = torch.empty(shape, dtype=dtype)
        ranks = stage.ranks[:1] if dim is None else stage.ranks
        written = 0  # along dim (1 for a replicated tensor, copied whole)
        for r, rank in enumerate(ranks):
            local = list(rank.meta(key)[0])
            if narrow:
                local[narrow[0]] = narrow[2]
            if len(local) != len(shape) or any(n > m for i, (n, m) in enumerate(zip(shape, local)) if i != dim):
                raise ValueError(f"{rank.path}: {key} is {local}, too small for a piece of {shape}")
            block = local[dim] // stride if dim is not None else 0
            places = [(0, 0)] if dim is None else [(j * block, (j * len(ranks) + r) * block) for j in range(stride)]
            places = [(at, to) for at, to in places if dim is None or to < shape[dim]]
            if not places:
                continue  # this rank holds only rows beyond the kept ones (K/V copies, vocab padding)
            src = rank.get(key)
            if narrow:
                src = src.narrow(*narrow)
            if list(src.shape) != local:
                raise ValueError(f"{rank.path}: {key} holds {list(src.shape)}, its metadata says {local}")
            for at, to in places:
                src_idx = [slice(0, n) for n in shape]
                dst_idx = [slice(None)] * len(shape)
                if dim is not None:
                    length = min(block, shape[dim] - to)
                    src_idx[dim], dst_idx[dim] = slice(at, at + length), slice(to, to + length)
                out[tuple(dst_idx)] = src[tuple(src_idx)]
                written += 1 if dim is None else length
            del src
        if written != (1 if dim is None else shape[dim]):
            raise ValueError(
                f"{stage.ranks[0].path}: the ranks' pieces of {key} fill {written} of {shape[dim]} indices of "
                f"dim {dim} (partition_stride={stride}, tp={len(ranks)}); the partitioning metadata does not fit"
            )
        return out

    def _gather_heads(
        self,
        stage: _Stage,
        key: str,
        shape: list[int],
        dtype: torch.dtype,
        dim: int,
        num_heads: int,
        orders: list[torch.Tensor],
        narrow: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        """Like ``_gather`` along ``dim``, but rank r's heads (blocks of ``dim``) go to the global
        heads ``orders[r]``: the inverse of the GQA layer's query-head permutation."""
        out = torch.empty(shape, dtype=dtype)
        heads = out.view(num_heads, -1) if dim == 0 else out.view(shape[0], num_heads, -1)
        if len(orders) != len(stage.ranks) or sum(len(o) for o in orders) != num_heads:
            raise ValueError(f"{key}: {len(stage.ranks)} ranks do not hold the {num_heads} heads once each")
        for rank, order in zip(stage.ranks, orders):
            src = rank.get(key)
            if narrow:
                src = src.narrow(*narrow)
            if src.numel() * num_heads != out.numel() * len(order):
                raise ValueError(
                    f"{rank.path}: {key} holds {list(src.shape)}, not {len(order)} of the heads of {shape}"
                )
            if dim == 0:
                heads[order] = src.reshape(len(order), -1)
            else:
                heads[:, order] = src.reshape(shape[0], len(order), -1)
            del src
        return out
