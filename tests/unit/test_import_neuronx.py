"""Import of optimum-neuron / neuronx-distributed checkpoints: fixtures are written here from the
format description (rank-local state dicts saved with torch.save, xser reference files, metadata
JSON / pickles), sharded from a random Llama state dict the test keeps, then consolidated and
compared with it bit for bit."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from neuron_parallel.checkpoint import export_checkpoint
from neuron_parallel.checkpoint.neuronx import NeuronxCheckpoint
from neuron_parallel.checkpoint.neuronx_layout import _RankFile, find_neuronx_checkpoint, query_head_order

HIDDEN, LAYERS, HEADS, INTERMEDIATE = 64, 2, 4, 96
HEAD_DIM = HIDDEN // HEADS


def llama_config(kv_heads: int = 2, vocab: int = 128):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )


def original_state(config) -> dict[str, torch.Tensor]:
    """Random tensors under every name (and shape) of the Hugging Face model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}


# --- sharding, written from what the layers hold on each rank ---------------------------------------


def gqa_query_heads(tp: int, rank: int, kv_heads: int, mult: int) -> list[int]:
    """The query heads rank ``rank`` holds in the GQA QKV layer: kv heads are laid out ``mult``
    times over the ranks, and each rank takes the next query heads of the group of each kv head it
    holds (groups handed out in rank order)."""
    layout = list(range(kv_heads)) * mult
    per_rank, group = len(layout) // tp, HEADS // kv_heads
    q_per_kv = HEADS // tp // per_rank
    handed = {k: 0 for k in range(kv_heads)}
    held = {}
    for r in range(tp):
        held[r] = []
        for k in layout[r * per_rank : (r + 1) * per_rank]:
            held[r] += [k * group + handed[k] + i for i in range(q_per_kv)]
            handed[k] += q_per_kv
    return held[rank]


def shard_state(state, config, *, tp, pp, attn="plain", mult=1, fuse_mlp=True):
    """{(tp_rank, pp_rank): rank-local state dict} and {pp_rank: {"parameters", "specs"}} the way
    optimum-neuron's training Llama lays its weights out (layers split evenly over stages)."""
    kv, vocab_rows = config.num_key_value_heads, -(-config.vocab_size // tp) * tp
    per_stage = LAYERS // pp
    shards = {(t, p): {} for t in range(tp) for p in range(pp)}
    meta = {p: {"parameters": {}, "model_weight_transformation_specs": []} for p in range(pp)}

    def par(p, name, dim, stride=1):
        meta[p]["parameters"][name] = {
            "tensor_model_parallel": True,
            "partition_dim": dim,
            "partition_stride": stride,
            "num_partitions": tp,
        }

    def rep(p, name):
        meta[p]["parameters"][name] = {"tensor_model_parallel": False}
        for t in range(tp):
            shards[t, p][name] = state[name].clone()

    def split(p, name, dim, key=None, tensor=None):
        par(p, key or name, dim)
        for t, piece in enumerate((state[name] if tensor is None else tensor).chunk(tp, dim)):
            shards[t, p][key or name] = piece.clone()

    pad = torch.zeros(vocab_rows - config.vocab_size, HIDDEN, dtype=torch.bfloat16)
    split(0, "model.embed_tokens.weight", 0, tensor=torch.cat([state["model.embed_tokens.weight"], pad]))
    for layer in range(LAYERS):
        p, pre = layer // per_stage, f"model.layers.{layer}"
        rep(p, f"{pre}.input_layernorm.weight")
        rep(p, f"{pre}.post_attention_layernorm.weight")
        q, k, v, o = (state[f"{pre}.self_attn.{n}_proj.weight"] for n in "qkvo")
        if attn == "plain":
            for n in "qkv":
                split(p, f"{pre}.self_attn.{n}_proj.weight", 0)
            split(p, f"{pre}.self_attn.o_proj.weight", 1)
        elif attn == "fused_mha":  # ColumnParallelLinear(stride=3) + FusedLinearsSpec
            name = f"{pre}.self_attn.qkv_proj.weight"
            par(p, name, 0, stride=3)
            for t in range(tp):
                shards[t, p][name] = torch.cat([w.chunk(tp)[t] for w in (q, k, v)]).clone()
            meta[p]["model_weight_transformation_specs"].append(
                {
                    "module_fully_qualified_name": f"{pre}.self_attn",
                    "specs": [
                        [
                            "FusedLinearsSpec",
                            {
                                "fused_linear_name": "qkv_proj",
                                "linear_names": ["q_proj", "k_proj", "v_proj"],
                                "bias": False,
                                "fuse_axis": 0,
                                "original_dims": [HEADS * HEAD_DIM] * 3,
                                "tp_size": tp,
                                "peft_type": None,
                            },
                        ]
                    ],
                }
            )
            split(p, f"{pre}.self_attn.o_proj.weight", 1)
        else:  # the GQA QKV layer: "gqa_fused" (weight_qkv) or "gqa" (weight_q/k/v)
            kv_rows = kv * mult // tp * HEAD_DIM
            for t in range(tp):
                heads = gqa_query_heads(tp, t, kv, mult)
                lq = q.view(HEADS, HEAD_DIM, HIDDEN)[heads].reshape(-1, HIDDEN)
                lk, lv = (w.repeat(mult, 1)[t * kv_rows : (t + 1) * kv_rows] for w in (k, v))
                lo = o.view(HIDDEN, HEADS, HEAD_DIM)[:, heads].reshape(HIDDEN, -1)
                if attn == "gqa_fused":
                    shards[t, p][f"{pre}.self_attn.qkv_proj.weight_qkv"] = torch.cat([lq, lk, lv]).clone()
                else:
                    for n, w in zip("qkv", (lq, lk, lv)):
                        shards[t, p][f"{pre}.self_attn.qkv_proj.weight_{n}"] = w.clone()
                shards[t, p][f"{pre}.self_attn.o_proj.weight"] = lo.clone()
            if attn == "gqa_fused":  # the trainer records no partitioning for weight_qkv
                meta[p]["parameters"][f"{pre}.self_attn.qkv_proj.weight_qkv"] = {"tensor_model_parallel": False}
            else:
                for n in "qkv":
                    par(p, f"{pre}.self_attn.qkv_proj.weight_{n}", 0)
            par(p, f"{pre}.self_attn.o_proj.weight", 1)
            meta[p]["model_weight_transformation_specs"].append(
                {
                    "module_fully_qualified_name": f"{pre}.self_attn",
                    "specs": [
                        [
                            "GQAQKVColumnParallelLinearSpec",
                            {
                                "gqa_qkv_projection_name": "qkv_proj",
                                "query_projection_name": "q_proj",
                                "key_projection_name": "k_proj",
                                "value_projection_name": "v_proj",
                                "output_projection_name": "o_proj",
                                "num_attention_heads": HEADS,
                                "num_key_value_heads": kv,
                                "kv_size_multiplier": mult,
                                "q_output_size_per_partition": HEADS // tp * HEAD_DIM,
                                "kv_output_size_per_partition": kv_rows,
                                "fuse_qkv": attn == "gqa_fused",
                                "bias": False,
                                "tp_size": tp,
                                "peft_type": None,
                            },
                        ]
                    ],
                }
            )
        gate, up = state[f"{pre}.mlp.gate_proj.weight"], state[f"{pre}.mlp.up_proj.weight"]
        if fuse_mlp:  # ColumnParallelLinear(stride=2) + FusedLinearsSpec
            name = f"{pre}.mlp.gate_up_proj.weight"
            par(p, name, 0, stride=2)
            for t in range(tp):
                shards[t, p][name] = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]]).clone()
            meta[p]["model_weight_transformation_specs"].append(
                {
                    "module_fully_qualified_name": f"{pre}.mlp",
                    "specs": [
                        [
                            "FusedLinearsSpec",
                            {
                                "fused_linear_name": "gate_up_proj",
                                "linear_names": ["gate_proj", "up_proj"],
                                "bias": False,
                                "fuse_axis": 0,
                                "original_dims": [INTERMEDIATE] * 2,
                                "tp_size": tp,
                                "peft_type": None,
                            },
                        ]
                    ],
                }
            )
        else:
            split(p, f"{pre}.mlp.gate_proj.weight", 0)
            split(p, f"{pre}.mlp.up_proj.weight", 0)
        split(p, f"{pre}.mlp.down_proj.weight", 1)
    rep(pp - 1, "model.norm.weight")
    split(pp - 1, "lm_head.weight", 0)
    return shards, meta


# --- writing the files ---------------------------------------------------------------------------


class TensorReference:
    """What torch_xla's xser leaves in the state dict in place of a tensor."""

    def __init__(self, tid: int) -> None:
        self.tid = tid


@pytest.fixture
def xser_pickling(monkeypatch):
    """torch_xla is not installed: give pickle a module to find TensorReference in."""
    TensorReference.__module__ = "torch_xla.utils.serialization"
    for name in ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization"):
        mod = types.ModuleType(name)
        mod.TensorReference = TensorReference
        monkeypatch.setitem(sys.modules, name, mod)


def save_rank(obj, path: Path, *, xser: bool, info: bool = True) -> None:
    """torch.save, or xser: each tensor in ``<path>.tensors/tensor_{id}.pt``, references in ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not xser:
        torch.save(obj, path)
        return
    tensors_dir, tensor_info, counter = Path(str(path) + ".tensors"), {}, iter(range(10**6))
    tensors_dir.mkdir()

    def refs(value):
        if isinstance(value, dict):
            return {k: refs(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            tid = next(counter)
            torch.save(value, tensors_dir / f"tensor_{tid}.pt")
            tensor_info[tid] = {"dtype": value.dtype, "shape": value.shape}
            return TensorReference(tid)
        return value

    torch.save(refs(obj), path)
    if info:
        torch.save(tensor_info, Path(str(path) + ".info.pt"))


def write_trainer_checkpoint(ckpt: Path, shards, meta, *, xser=False, info=True, pt_metadata=None) -> Path:
    """Layout (a): shards/model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt, mp_metadata_pp_rank_N.json, done."""
    for (t, p), state in shards.items():
        save_rank(
            state, ckpt / "shards" / "model" / f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt", xser=xser, info=info
        )
    for p, m in meta.items():
        if pt_metadata is not None:
            torch.save(pt_metadata[p], ckpt / "shards" / f"mp_metadata_pp_rank_{p}.pt")
        else:
            (ckpt / "shards" / f"mp_metadata_pp_rank_{p}.json").write_text(json.dumps(m, indent=4))
    (ckpt / "shards" / "checkpoint").write_text("1")
    (ckpt / "shards" / "done").write_text("1")
    return ckpt


def write_legacy_checkpoint(ckpt: Path, shards, meta, *, xser=False, gqa=None) -> Path:
    """Layout (b): shards/tp_rank_XX_pp_rank_YY/checkpoint.pt (xser: the file tp_rank_XX_pp_rank_YY)
    holding {"model", "sharded_metadata", "gqa_qkv_metadata"}."""
    for (t, p), state in shards.items():
        sharded = {
            n: {"kind": "sharded", "partition_dim": m["partition_dim"]}
            if m["tensor_model_parallel"]
            else {"kind": "tied", "partition_dim": None}
            for n, m in meta[p]["parameters"].items()
        }
        obj = {"model": state, "sharded_metadata": sharded}
        if gqa is not None:
            obj["gqa_qkv_metadata"] = gqa
        name = f"tp_rank_{t:02d}_pp_rank_{p:02d}"
        save_rank(obj, ckpt / "shards" / name if xser else ckpt / "shards" / name / "checkpoint.pt", xser=xser)
    return ckpt


def check_output(out: Path, state: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    written = load_file(out / "model.safetensors")
    assert written.keys() == state.keys()
    for name, t in state.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in state.items())


# --- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "pp", "kv", "attn", "mult", "xser", "info", "vocab"),
    [
        (2, 2, 2, "plain", 1, False, True, 128),
        (2, 2, 2, "plain", 1, True, True, 126),  # vocab padded to 128 over tp=2, trimmed back
        (4, 2, 2, "gqa_fused", 2, True, False, 128),  # xser without the .info.pt (neuronx-distributed <= 0.6)
        (4, 2, 2, "gqa", 2, False, True, 128),
        (4, 1, 1, "gqa_fused", 4, False, True, 128),  # one kv head replicated on every rank
        (2, 2, 4, "fused_mha", 1, False, True, 128),
    ],
    ids=["plain", "plain-xser-padded-vocab", "gqa-fused-xser-m2", "gqa-m2", "gqa-fused-m4", "fused-mha-qkv"],
)
def test_trainer_layout_consolidates_bit_for_bit(tmp_path, xser_pickling, tp, pp, kv, attn, mult, xser, info, vocab):
    config = llama_config(kv, vocab)
    state = original_state(config)
    shards, meta = shard_state(state, config, tp=tp, pp=pp, attn=attn, mult=mult)
    ckpt = write_trainer_checkpoint(tmp_path / "run" / "checkpoint-10", shards, meta, xser=xser, info=info)
    config.save_pretrained(tmp_path / "run")  # optimum-neuron saves it in the output dir, next to checkpoint-N
    out = export_checkpoint(ckpt, tmp_path / "hf")
    check_output(out, state)
    assert (out / "config.json").is_file()
    # The run dir resolves to its newest checkpoint-<step> with shards/done.
    (tmp_path / "run" / "checkpoint-5" / "shards" / "model").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-5" / "shards" / "done").write_text("1")
    assert find_neuronx_checkpoint(tmp_path / "run") == ckpt / "shards"


def test_legacy_folders_plain_and_xser(tmp_path, xser_pickling):
    config = llama_config()
    state = original_state(config)
    shards, meta = shard_state(state, config, tp=2, pp=2, fuse_mlp=False)
    config.save_pretrained(tmp_path / "model")
    for xser in (False, True):
        ckpt = write_legacy_checkpoint(tmp_path / f"legacy-{xser}", shards, meta, xser=xser)
        out = export_checkpoint(ckpt / "shards", tmp_path / f"hf-{xser}", model_dir=tmp_path / "model")
        check_output(out, state)


def test_legacy_gqa_without_permutation(tmp_path, xser_pickling):
    """Early GQA layer: Q heads split contiguously, K/V replicated kv_size_multiplier times."""
    config = llama_config()
    state = original_state(config)
    shards, meta = shard_state(state, config, tp=4, pp=1, attn="gqa", mult=2, fuse_mlp=False)
    for t in range(4):  # contiguous Q heads and plain O columns instead of the permuted ones
        for layer in range(LAYERS):
            pre = f"model.layers.{layer}.self_attn"
            shards[t, 0][f"{pre}.qkv_proj.weight_q"] = state[f"{pre}.q_proj.weight"].chunk(4)[t].clone()
            shards[t, 0][f"{pre}.o_proj.weight"] = state[f"{pre}.o_proj.weight"].chunk(4, 1)[t].clone()
    mapping = {
        f"model.layers.{i}.self_attn.{n}_proj.weight": f"model.layers.{i}.self_attn.qkv_proj.weight_{n}"
        for i in range(LAYERS)
        for n in "qkv"
    }
    gqa = {
        "original_names_to_gqa_qkv_names": mapping,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "kv_size_multiplier": 2,
    }
    ckpt = write_legacy_checkpoint(tmp_path / "ckpt", shards, meta, gqa=gqa)
    config.save_pretrained(ckpt)
    check_output(export_checkpoint(ckpt, tmp_path / "hf"), state)


def test_pickled_metadata_with_permuted_fused_gqa(tmp_path, xser_pickling):
    """optimum-neuron between the two: mp_metadata_pp_rank_N.pt with sharded_metadata and
    gqa_qkv_metadata (output_projections_names present: Q heads and O columns permuted)."""
    config = llama_config()
    state = original_state(config)
    shards, meta = shard_state(state, config, tp=4, pp=2, attn="gqa_fused", mult=2, fuse_mlp=False)
    pt_meta = {}
    for p, m in meta.items():
        layers = {n.split(".")[2] for n in m["parameters"] if n.startswith("model.layers.")}
        sharded = {
            n: {"kind": "sharded", "partition_dim": d["partition_dim"]}
            if d["tensor_model_parallel"]
            else {"kind": "tied", "partition_dim": None}
            for n, d in m["parameters"].items()
        }
        mapping = {
            f"model.layers.{i}.self_attn.{n}_proj.weight": f"model.layers.{i}.self_attn.qkv_proj.weight_qkv"
            for i in sorted(layers)
            for n in "qkv"
        }
        pt_meta[p] = {
            "sharded_metadata": sharded,
            "gqa_qkv_metadata": {
                "original_names_to_gqa_qkv_names": mapping,
                "output_projections_names": {f"model.layers.{i}.self_attn.o_proj.weight" for i in layers},
                "num_attention_heads": HEADS,
                "num_key_value_heads": 2,
                "kv_size_multiplier": 2,
                "fuse_qkv": True,
                "q_output_size_per_partition": HEAD_DIM,
                "kv_output_size_per_partition": HEAD_DIM,
            },
        }
    ckpt = write_trainer_checkpoint(tmp_path / "ckpt", shards, meta, pt_metadata=pt_meta)
    config.save_pretrained(ckpt)
    check_output(export_checkpoint(ckpt, tmp_path / "hf"), state)


def test_cli_with_model_dir(tmp_path, xser_pickling, capsys):
    from neuron_flows.flows.cli import main

    config = llama_config()
    state = original_state(config)
    shards, meta = shard_state(state, config, tp=2, pp=2)
    ckpt = write_trainer_checkpoint(tmp_path / "ckpt", shards, meta, xser=True)
    config.save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "tokenizer_config.json").write_text("{}")
    assert main(["consolidate", str(ckpt / "shards"), str(tmp_path / "hf"), "--model-dir", str(tmp_path / "base")]) == 0
    assert "consolidated:" in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()
    check_output(tmp_path / "hf", state)
    # Without a config anywhere near the checkpoint, the CLI says where it looked and what to pass.
    assert main(["consolidate", str(ckpt), str(tmp_path / "hf2")]) == 2
    assert "--model-dir" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["done", "rank", "last-rank", "metadata", "xser-tensor", "stage"])
def test_incomplete_checkpoint_is_refused_naming_the_fault(tmp_path, xser_pickling, fault):
    config = llama_config()
    state = original_state(config)
    shards, meta = shard_state(state, config, tp=2, pp=2)
    ckpt = write_trainer_checkpoint(tmp_path / "ckpt", shards, meta, xser=fault == "xser-tensor")
    config.save_pretrained(ckpt)
    model = ckpt / "shards" / "model"
    victim = {
        "done": ckpt / "shards" / "done",
        "rank": model / "dp_rank_00_tp_rank_00_pp_rank_01.pt",
        "last-rank": model / "dp_rank_00_tp_rank_01_pp_rank_01.pt",
        "metadata": ckpt / "shards" / "mp_metadata_pp_rank_1.json",
        "xser-tensor": model / "dp_rank_00_tp_rank_01_pp_rank_00.pt.tensors" / "tensor_3.pt",
    }.get(fault)
    if fault == "stage":  # a whole pipeline stage gone: files and metadata
        for p in list(model.glob("*pp_rank_01.pt")) + [ckpt / "shards" / "mp_metadata_pp_rank_1.json"]:
            p.unlink()
    else:
        victim.unlink()
    with pytest.raises(ValueError, match="refusing to consolidate") as err:
        export_checkpoint(ckpt, tmp_path / "hf")
    assert str(victim) in str(err.value) if victim else "a pipeline stage or rank is missing" in str(err.value)
    assert not (tmp_path / "hf").exists()


def test_query_head_order_matches_hand_computed_layouts():
    # tp=4, 4 heads, 2 kv heads twice over: ranks hold kv 0,1,0,1 → query heads 0,2,1,3.
    assert [query_head_order(4, r, 4, 2, 2).tolist() for r in range(4)] == [[0], [2], [1], [3]]
    # tp=4, 8 heads, 2 kv heads twice over.
    assert [query_head_order(4, r, 8, 2, 2).tolist() for r in range(4)] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    # kv heads divisible by tp: plain contiguous split.
    assert [query_head_order(2, r, 8, 4, 1).tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for tp, kv, mult in [(4, 2, 2), (4, 1, 4)]:
        assert [query_head_order(tp, r, HEADS, kv, mult).tolist() for r in range(tp)] == [
            gqa_query_heads(tp, r, kv, mult) for r in range(tp)
        ]


def test_reading_a_tensor_touches_only_its_pieces(tmp_path, xser_pickling, monkeypatch):
    """Each Hugging Face tensor reads only the rank entries that hold part of it; with K/V
    replicated twice over tp=4, only the two ranks holding the first copy are read."""
    config = llama_config()
    state = original_state(config)
    shards, meta = shard_state(state, config, tp=4, pp=2, attn="gqa", mult=2)
    ckpt = write_trainer_checkpoint(tmp_path / "ckpt", shards, meta, xser=True)
    config.save_pretrained(ckpt)
    source = NeuronxCheckpoint(ckpt / "shards")
    reads: list[tuple[str, str]] = []
    real_get = _RankFile.get
    monkeypatch.setattr(_RankFile, "get", lambda self, key: reads.append((self.path.name, key)) or real_get(self, key))
    k = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(source.read(k), state[k])
    key = "model.layers.1.self_attn.qkv_proj.weight_k"
    assert reads == [(f"dp_rank_00_tp_rank_0{t}_pp_rank_01.pt", key) for t in (0, 1)]
    reads.clear()
    assert torch.equal(source.read("model.layers.0.mlp.up_proj.weight"), state["model.layers.0.mlp.up_proj.weight"])
    assert {key for _, key in reads} == {"model.layers.0.mlp.gate_up_proj.weight"} and len(reads) == 4


def test_xser_reference_states():
    from neuron_parallel.checkpoint.neuronx_layout import _TensorReference

    for state in ({"tid": 3}, (None, {"tid": 3})):  # plain class, and a __slots__ variant
        ref = _TensorReference.__new__(_TensorReference)
        ref.__setstate__(state)
        assert ref.tid == 3
    with pytest.raises(ValueError, match="integer id"):
        _TensorReference.__new__(_TensorReference).__setstate__({"tid": "3"})
