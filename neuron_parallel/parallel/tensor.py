"""Tensor parallelism (and optional sequence parallelism) for a :class:`CausalLMStage`.

Megatron-style sharding expressed with ``torch.distributed.tensor`` (DTensor), so the same code
runs on gloo, nccl and the neuron backend:

* attention: q/k/v ColwiseParallel (each tp rank holds whole heads), o RowwiseParallel;
* MLP: gate/up ColwiseParallel, down RowwiseParallel;
* embedding vocab-parallel (RowwiseParallel, with a local masked lookup so its gradient stays
  sharded), lm_head ColwiseParallel with logits left sharded over the vocabulary for
  ``torch.distributed.tensor.parallel.loss_parallel()``; tied weights stay tied;
* norms replicated; with sequence parallelism they run on sequence shards (``Shard(1)``);
  Qwen3's per-head q_norm/k_norm replicated, run on the local heads.

Every parameter becomes a DTensor whose global shape is the Hugging Face shape, so checkpoints,
consolidation and loading by Hugging Face name need no special cases.

GQA with ``tp > num_key_value_heads``: K/V heads are replicated ``m = tp // num_kv_heads``
times (optimum-neuron's ``kv_size_multiplier``). k_proj/v_proj live on a 2-D view of the tp
mesh, ``(tp_kv=num_kv_heads, tp_rep=m)``, with placements ``[Shard(0), Replicate()]``: tp rank
``r`` holds exactly kv head ``r // m``, the one its query heads use. Their forward runs on
local tensors and declares the weight gradient ``Partial`` over ``tp_rep`` (each replica only
sees its own query heads' contribution); :func:`align_grad_placements` sums the replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..models.causal_lm import CausalLMStage
from ..planning.layout import check_tp
from ..planning.memory import ModelShape
from .dtensor import align_grads
from .lora import LoRAColwise, LoRALinear, LoRARowwise


def kv_size_multiplier(num_kv_heads: int, tp: int) -> int:
    """How many tp ranks share (hold a copy of) each KV head: ``max(1, tp // num_kv_heads)``."""
    return max(1, tp // num_kv_heads)


def align_grad_placements(params) -> None:
    """Redistribute every DTensor gradient to its parameter's mesh and placements, in place.

    After a TP backward some gradients do not match their parameter: sequence-parallel norm
    weights, q_norm/k_norm and replicated KV projections come back ``Partial`` (a sum is still
    owed over tp: all-reduced here); a ``Replicate`` grad of a sharded weight is just sliced.
    DTensor ops would cope implicitly, but anything that works on local tensors (dp all-reduce,
    ZeRO, clipping via ``to_local``) would read wrong values. Call it once per optimizer step,
    after the last micro-batch's backward and before clipping and the optimizer (the dp
    average of local shards commutes with it, so it may come before or after). Collectives over
    tp: one all-reduce per mesh dim for all ``Partial`` grads of a mesh together
    (:func:`~neuron_parallel.parallel.dtensor.align_grads`), whatever the number of layers; every
    tp rank must call it with the same parameters in the same order.
    """
    align_grads(params)


def apply_tensor_parallel(
    stage: CausalLMStage, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool = True
) -> CausalLMStage:
    """Shard ``stage`` over the 1-D ``tp_mesh``, in place, on the META device (before
    ``materialize`` and ``load_weights``, which then fill each rank's slice by its global offset).

    Collectives per decoder layer (b·s·h elements each, on the tp group):

    * without sequence parallelism: forward one all-reduce after o_proj and one after down_proj;
      backward one all-reduce of the input gradient of attention and of the MLP.
    * with ``sequence_parallel``: activations between blocks are ``Shard(1)`` (sequence); forward
      all-gather before attention and before the MLP, reduce-scatter after o_proj and
      down_proj; backward the mirror image (reduce-scatter / all-gather). Norms run on
      sequence shards. The sequence length must be divisible by tp (checked before the
      forward's first collective); the stage records ``sequence_shards = tp`` so that later
      pipeline stages recover the full length for rotary positions.

    Embedding: forward all-reduce (reduce-scatter with SP) of the masked vocab-parallel lookup.
    lm_head: with SP an all-gather of the sequence before it; with ``loss_parallel`` the logits
    stay a vocab-sharded DTensor and the caller must compute the loss (forward *and* backward)
    inside ``torch.distributed.tensor.parallel.loss_parallel()``; cross-entropy then only
    reduces per-token scalars. With ``loss_parallel=False`` logits are all-gathered into a plain
    replicated tensor. After backward, :func:`align_grad_placements` all-reduces the ``Partial``
    grads of replicated weights (SP norms, q_norm/k_norm over tp; replicated K/V over their
    ``m`` replicas).

    Raises ``ValueError`` when tp does not fit the model's heads, KV heads, MLP or vocabulary.
    A tp mesh of size 1 leaves the stage untouched.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D, got a {tp_mesh.ndim}-D mesh; pass mesh['tp']")
    tp = tp_mesh.size()
    config = stage.config
    check_tp(ModelShape.from_config(config), tp, vocab=stage.first or stage.last)
    if tp == 1:
        return stage

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    m = kv_size_multiplier(kv_heads, tp)
    kv_style: ParallelStyle | None = None  # None: column-parallel like q_proj
    if m > 1:
        kv_style = _ReplicatedKVColwise(_kv_mesh(tp_mesh, kv_heads, m))
    seq = Shard(1) if sequence_parallel else Replicate()
    if sequence_parallel:
        stage.sequence_shards = tp
        stage.register_forward_pre_hook(_check_seq_len, with_kwargs=True)
    norm_style = SequenceParallel if sequence_parallel else _ReplicateParallel

    top: dict[str, ParallelStyle] = {}
    if stage.first:
        top["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if stage.last:
        top["model.norm"] = norm_style()
        top["lm_head"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    tied = stage.first and stage.last and stage.lm_head.weight is stage.model.embed_tokens.weight
    parallelize_module(stage, tp_mesh, top, src_data_rank=None)  # weights are loaded later
    if stage.first:
        stage.model.embed_tokens.__class__ = _VocabParallelEmbedding  # local lookup, sharded grad
    if tied:
        # Both styles shard dim 0 (vocab) the same way, but each registered its own DTensor.
        stage.lm_head.weight = stage.model.embed_tokens.weight

    for layer in stage.model.layers.values():
        parallelize_module(layer, tp_mesh, _layer_plan(layer, seq, norm_style, kv_style), src_data_rank=None)
        # HF reshapes with view(..., -1, head_dim), so only the GQA group size needs fixing.
        local_kv = 1 if m > 1 else kv_heads // tp
        layer.self_attn.num_key_value_groups = (heads // tp) // local_kv
    return stage


def _colwise(linear: nn.Module) -> ParallelStyle:
    return LoRAColwise() if isinstance(linear, LoRALinear) else ColwiseParallel()


def _rowwise(linear: nn.Module, seq) -> ParallelStyle:
    return (LoRARowwise if isinstance(linear, LoRALinear) else RowwiseParallel)(output_layouts=seq)


def _layer_plan(layer: nn.Module, seq, norm_style, kv_style: ParallelStyle | None) -> dict[str, ParallelStyle]:
    """The TP plan of one decoder layer; ``seq`` is the layout of activations between blocks."""
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": norm_style(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "self_attn.q_proj": _colwise(layer.self_attn.q_proj),
        "self_attn.k_proj": kv_style if kv_style is not None else _colwise(layer.self_attn.k_proj),
        "self_attn.v_proj": kv_style if kv_style is not None else _colwise(layer.self_attn.v_proj),
        "self_attn.o_proj": _rowwise(layer.self_attn.o_proj, seq),
        "post_attention_layernorm": norm_style(),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": _colwise(layer.mlp.gate_proj),
        "mlp.up_proj": _colwise(layer.mlp.up_proj),
        "mlp.down_proj": _rowwise(layer.mlp.down_proj, seq),
    }
    # Qwen3's per-head RMSNorm sees (batch, seq, local heads, head_dim): treat it as sharded
    # on the heads dim so its replicated weight gets a Partial grad summed over tp.
    for name in ("q_norm", "k_norm"):
        if isinstance(getattr(layer.self_attn, name, None), nn.Module):
            plan[f"self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


_KV_MESHES: dict[tuple[DeviceMesh, int, int], tuple[object, DeviceMesh]] = {}


def _kv_mesh(tp_mesh: DeviceMesh, kv_heads: int, m: int) -> DeviceMesh:
    """The tp ranks viewed as (kv head, replica): rank r sits at (r // m, r % m).

    Building it creates two sets of process groups collectively (every rank must call it), so
    it is built once per tp mesh and shared by all stages of the rank; the entry is tied to the
    current default process group so a re-initialised world never reuses stale groups.
    """
    if tp_mesh.mesh_dim_names is None:
        raise ValueError("KV-head replication needs a named tp mesh (init_device_mesh(..., mesh_dim_names=...))")
    key, world = (tp_mesh, kv_heads, m), dist.group.WORLD
    cached = _KV_MESHES.get(key)
    if cached is None or cached[0] is not world:
        cached = _KV_MESHES[key] = (world, tp_mesh._unflatten(0, (kv_heads, m), ("tp_kv", "tp_rep")))
    return cached[1]


def _check_seq_len(stage: CausalLMStage, args, kwargs) -> None:
    """Refuse a sequence that does not split over the tp ranks, before any collective."""
    tp = stage.sequence_shards
    positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
    seq_len = kwargs.get("seq_len") or (positions.shape[-1] if positions is not None else stage.full_seq_len(args[0]))
    if seq_len % tp:
        raise ValueError(
            f"sequence parallelism shards the sequence over tp={tp} ranks, but seq_len={seq_len} "
            f"is not divisible by {tp}; use a block size that is a multiple of {tp}"
        )


class _ReplicateParallel(ParallelStyle):
    """Replicated weights on replicated activations (norms without sequence parallelism): the
    weights become ``Replicate`` DTensors like every other parameter, no communication."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate_params(_name, mod, mesh):
            for name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()], run_check=False)))

        def input_fn(mod, inputs, mesh):
            x = inputs[0]
            if isinstance(x, DTensor):
                return x.redistribute(placements=[Replicate()])
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

        return distribute_module(module, device_mesh, replicate_params, input_fn, None)


class _VocabParallelEmbedding(nn.Embedding):
    """The lookup of a RowwiseParallel (vocab-sharded) embedding, done on the local shard.

    DTensor's own embedding backward has no vocab-sharded rule: every rank would build the
    full ``vocab × hidden`` gradient (``Replicate``), costly in memory for large vocabularies.
    Here each rank looks up the ids it holds (others give zeros), so the weight gradient is the
    local ``Shard(0)`` piece with no communication. RowwiseParallel's hooks still wrap the ids
    and reduce the ``Partial`` output (all-reduce, or reduce-scatter under SP).
    """

    def forward(self, ids: DTensor) -> DTensor:
        mesh = self.weight.device_mesh
        weight = self.weight.to_local()
        lo, rows = mesh.get_local_rank() * weight.shape[0], weight.shape[0]
        ids = ids.to_local()
        outside = (ids < lo) | (ids >= lo + rows)
        pad = self.padding_idx
        pad = pad - lo if pad is not None and lo <= pad < lo + rows else None
        out = F.embedding(torch.where(outside, 0, ids - lo), weight, pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return DTensor.from_local(out, mesh, [Partial()], run_check=False)


class _KVReplicaLinear(nn.Linear):
    """k_proj/v_proj holding one replicated KV head per tp rank (see the module docstring).

    The parameters are DTensors on the 2-D ``(tp_kv, tp_rep)`` mesh, the input a ``Replicate``
    DTensor on the 1-D tp mesh, so the product is computed on local tensors. Gradients are
    declared ``Partial`` where this rank holds only a share of the sum: the weight's over the
    replicas (summed by ``align_grad_placements``), the input's over all of tp (summed by the
    same reduction as q_proj's, so no extra collective).
    """

    tp_mesh: DeviceMesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        if tuple(x.placements) != (Replicate(),):
            x = x.redistribute(placements=[Replicate()])
        # No redistribute when x is already replicated: its backward would all-reduce the Partial
        # input gradient here, for k and for v, instead of once with q_proj's in the reduction of
        # the block's input (a reduce-scatter under SP).
        x = x.to_local(grad_placements=[Partial()])
        grads = [Shard(0), Partial()]
        weight = self.weight.to_local(grad_placements=grads)
        bias = self.bias.to_local(grad_placements=grads) if self.bias is not None else None
        out = F.linear(x, weight, bias)
        if getattr(self, "lora_A", None) is None:
            return out
        # The adapter of a replicated KV head (neuron_parallel.parallel.lora): B is laid out like
        # the weight, A replicated; A's gradient is a share of a sum over every tp rank.
        a = self.lora_A.to_local(grad_placements=[Partial(), Partial()])
        b = self.lora_B.to_local(grad_placements=grads)
        z = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + F.linear(F.linear(z, a), b) * self.lora_scale


class _ReplicatedKVColwise(ParallelStyle):
    """ColwiseParallel for K/V projections when tp exceeds the KV heads (``m`` ranks per head)."""

    def __init__(self, kv_mesh: DeviceMesh) -> None:
        self.kv_mesh = kv_mesh

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) not in (nn.Linear, LoRALinear):
            raise ValueError(
                f"KV-head replication needs nn.Linear k/v projections, got {type(module).__name__}; "
                "use tp <= num_key_value_heads for this model"
            )
        for name, p in list(module.named_parameters(recurse=False)):
            place = [Replicate(), Replicate()] if name == "lora_A" else [Shard(0), Replicate()]
            dp = distribute_tensor(p, self.kv_mesh, place, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(dp, requires_grad=p.requires_grad))
        module.__class__ = _KVReplicaLinear  # same state, forward on local shards
        module.tp_mesh = device_mesh
        return module
