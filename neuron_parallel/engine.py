"""The parallel model of one rank: its stage modules, optimizer, and one training step's
forward, backward, gradient reduction and update.

``build_engine`` applies, in order: pipeline split (activation checkpointing inside the stage
forward) → LoRA adapters, when asked → tensor + sequence parallelism → materialisation and weight
loading (then the adapters' initialisation and the frozen base) → with ``train.compile``, each
decoder layer compiled in place (:func:`compile_layers`; a checkpointed layer recomputes its
compiled forward) → pipeline schedule, and under context parallelism each stage's place on the cp
axis; the ``Engine`` then builds the optimizer (torch's fused AdamW wherever the device has it,
under every layout; ZeRO-1 over the dp × cp ranks when asked) and the gradient reducer over the
same ranks. Under context parallelism every micro-batch is cut to this rank's positions on the
host first (:mod:`neuron_parallel.parallel.context`). On CUDA fp32 matmuls run on TF32 tensor
cores (:func:`use_tf32_on_cuda`). Everything degenerates cleanly to one rank. Reading and
writing checkpoints is :mod:`neuron_parallel.checkpoint.engine_state`'s business.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from .batches import Batch, to_device
from .checkpoint.tensors import HFWeights
from .config import JobConfig
from .mesh import ParallelDims
from .models.causal_lm import build_meta_model, load_config, load_weights, materialize
from .optim import FUSED_ADAMW_DEVICES, build_optimizer, clip_grad_norm
from .parallel.context import ContextShard
from .parallel.data_parallel import GradReducer
from .parallel.dtensor import full
from .parallel.lora import add_lora, freeze_base, init_adapters, is_adapter
from .parallel.pipeline import PipelineRunner, build_stages, stage_ids_for_rank, sum_tied_embedding_grads
from .parallel.pipeline_losses import pipeline_loss, reference_runner
from .parallel.tensor import align_grad_placements, apply_tensor_parallel


@dataclass
class Engine:
    """What one rank trains: its stage modules and the optimizer over their parameters."""

    job: JobConfig
    dims: ParallelDims
    device: torch.device
    config: object
    parts: list[nn.Module]
    stage_ids: list[int]
    runner: PipelineRunner | None = None
    reference_runner: PipelineRunner | None = None
    """Under pipeline parallelism, the forward-only pass of DPO under LoRA's reference
    (``parallel.pipeline_losses.reference_runner``); None otherwise."""
    optimizer: object = field(init=False)
    grad_reducer: GradReducer | None = field(init=False)
    """Sums gradients over the dp × cp ranks while backward runs (None when dp × cp = 1): the
    loss of each rank is already divided by the whole global batch's count
    (``neuron_parallel.train.LOSS_RULE``), so the sum is the gradient of the global mean."""

    def __post_init__(self) -> None:
        # ZeRO-1 shards the optimizer state over every rank holding the same parameters (dp × cp):
        # the gradients are reduced over them anyway, and checkpoints store each tensor by name
        # and global slice, so a run resumes on any dp and cp.
        zero_1 = self.job.parallel.zero_1 and self.dims.dp_cp > 1
        self.optimizer = build_optimizer(
            self.named_parameters(),
            self.job.train,
            # One fused kernel for all parameters: about 3x faster than the per-tensor loop on
            # CPU. DTensor parameters (TP) run it on their local shards, as ZeRO-1's plain aliases
            # and LoRA's adapters do.
            fused=self.device.type in FUSED_ADAMW_DEVICES,
            dp_group=self.dims.group("dp_cp") if zero_1 else None,
        )
        self.grad_reducer = None
        if self.dims.dp_cp > 1:
            self.grad_reducer = GradReducer(self.parameters(), self.dims.group("dp_cp"), self.dims.dp_cp)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def tied_trainable(self) -> bool:
        """Whether the tied embedding is trained (always, unless LoRA leaves it frozen)."""
        return self.lora is None or bool({"lm_head", "embed_tokens"} & set(self.lora.modules_to_save))

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def lora(self):
        return self.job.train.lora

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The trainable parameters of this rank's stages, each once: every weight, or under LoRA
        the adapters and ``modules_to_save`` (the frozen base is in :meth:`frozen_parameters`)."""
        return [(n, p) for n, p in self._all_parameters() if p.requires_grad]

    def frozen_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self._all_parameters() if not p.requires_grad]

    def _all_parameters(self) -> list[tuple[str, nn.Parameter]]:
        seen, out = set(), []
        for part in self.parts:
            for name, p in part.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def _compute(self):
        """The autocast and loss-parallel contexts of a forward/backward."""
        stack = contextlib.ExitStack()
        if self.dims.tp > 1:
            stack.enter_context(loss_parallel())
        if self.job.parallel.mixed_precision == "bf16":
            # fp32 parameters are the master weights; matmuls run in bf16.
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        return stack

    @property
    def context(self) -> ContextShard | None:
        """This rank's place on the cp axis (None without context parallelism)."""
        return self.parts[0].context

    def forward_backward(self, batch: Batch, scale: float, *, last: bool = True) -> torch.Tensor:
        """Run one micro-batch; gradients accumulate as those of ``loss × scale``. Returns the
        loss, the sum over its labelled tokens (the same value on every rank of the tensor- and
        pipeline-parallel groups; under context parallelism the sum over this rank's positions,
        so that the sum over the dp × cp ranks is the whole batch's). ``last``: the last
        micro-batch before :meth:`reduce_and_clip`, whose backward starts the gradient reduction
        of each bucket as it completes (under pipeline parallelism, at each stage's last
        microbatch). Under a preference objective the loss is that of the batch's pairs, and the
        value returned is :meth:`pair_stats` (the summed loss first; under context parallelism
        on cp rank 0, zeros on the others, whose stats are the same)."""
        if last and self.grad_reducer is not None:
            self.grad_reducer.arm(self.runner.num_microbatches if self.runner is not None else 1)
        batch = self._local(batch)
        self._attend(batch)
        with self._compute():
            if self.runner is not None:
                self.runner.loss_scale = scale
                return self._share(self.runner.step(*self._pipeline_args(batch), documents=self._documents(batch)))
            if self.preference:
                stats = self.pair_stats(batch)
                (stats[0] * scale).backward()
                return self._share(stats.detach())
            loss = self.parts[0].loss(self._forward(batch), to_device(batch.labels, self.device))
            (loss * scale).backward()
        return full(loss.detach())

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        """The summed loss of ``batch`` over its labelled tokens, forward only, in eval mode."""
        for part in self.parts:
            part.eval()
        batch = self._local(batch)
        self._attend(batch)
        try:
            with self._compute():
                if self.runner is not None:
                    return self._share(self.runner.step(*self._pipeline_args(batch), documents=self._documents(batch)))
                if self.preference:
                    return self._share(self.pair_stats(batch))
                return full(self.parts[0].loss(self._forward(batch), to_device(batch.labels, self.device)))
        finally:
            for part in self.parts:
                part.train()

    @property
    def preference(self) -> bool:
        """Whether the job trains a preference objective (:mod:`neuron_parallel.preference`)."""
        return self.job.train.objective != "sft"

    def pair_stats(self, batch: Batch) -> torch.Tensor:
        """The :data:`~neuron_parallel.preference.STATS` of ``batch``'s pairs, summed (a vector on
        the device, the same on every rank of the tensor- and context-parallel groups): the
        policy's per-token log-probabilities segment-summed per completion on the device (under
        context parallelism over every cp rank's positions,
        :func:`~neuron_parallel.preference.completion_logps`), and under DPO the
        reference's, from a forward of the base with the adapters off (LoRA, no gradient) or
        from the reference step's values read with the rows."""
        from .preference import completion_logps, pair_stats

        tc = self.job.train
        stage = self.parts[0]
        labels = to_device(batch.labels, self.device)
        seq_ids = to_device(batch.sequence_ids, self.device)
        sums, counts = completion_logps(stage, self._forward(batch), labels, seq_ids)
        reference = None
        if tc.objective == "dpo":
            if batch.reference is not None:
                reference = to_device(batch.reference, self.device).view(sums.shape)
            else:
                with torch.no_grad(), self._adapters_off():
                    reference, _ = completion_logps(stage, self._forward(batch), labels, seq_ids)
        return pair_stats(tc.objective, tc.preference, sums, counts, reference)

    @contextlib.contextmanager
    def _adapters_off(self):
        """The frozen base alone: every LoRA adapter of this rank's stages switched off."""
        from .parallel.lora import LoRALinear

        layers = [m for part in self.parts for m in part.modules() if isinstance(m, LoRALinear)]
        if not layers:
            raise ValueError(
                "train.objective=dpo without train.lora needs the reference step's log-probabilities "
                "(job reference_path); run the reference step, or set train.lora"
            )
        for m in layers:
            m.lora_enabled = False
        try:
            yield
        finally:
            for m in layers:
                m.lora_enabled = True

    def _attend(self, batch: Batch) -> None:
        """Rows that plain causal attention trains exactly (``batch.causal``, known on the host
        when the rows were read) take the mask-free causal path on every stage."""
        for part in self.parts:
            part.mask_documents = not batch.causal

    def _local(self, batch: Batch) -> Batch:
        """``batch`` as this rank computes it: under context parallelism its rows cut to this cp
        rank's positions, on the host (:func:`~neuron_parallel.parallel.context.shard_batch`)."""
        return batch if self.context is None else self.context.shard_batch(batch)

    def _share(self, stats: torch.Tensor) -> torch.Tensor:
        """A preference step's stats as this rank's share of the sum over the dp × cp ranks: under
        context parallelism every cp rank holds the whole stats, so cp rank 0 counts them."""
        if self.context is None or self.context.cp_rank == 0 or not self.preference:
            return stats
        return torch.zeros_like(stats)

    def _documents(self, batch: Batch) -> torch.Tensor | None:
        """What the first stage takes besides the positions under context parallelism."""
        return batch.documents if self.has_first else None

    def _forward(self, batch: Batch) -> torch.Tensor:
        """The final norm's output of the one stage."""
        inputs = to_device(batch.inputs, self.device)
        if batch.positions is None:
            return self.parts[0](inputs, seq_len=inputs.shape[1])
        positions = to_device(batch.positions, self.device)
        if batch.documents is None:
            return self.parts[0](inputs, positions)
        return self.parts[0](inputs, positions, to_device(batch.documents, self.device))

    def _pipeline_args(self, batch: Batch) -> tuple:
        """``PipelineRunner.step``'s arguments for ``batch``; under a preference objective with the
        rows ``PairLoss`` takes: the sequence ids and, under DPO, the reference's log-probabilities,
        read with the rows or (LoRA) from the reference pass, run here first."""
        inputs = batch.inputs if self.has_first else None
        args = (inputs, batch.labels, batch.positions if self.has_first else None)
        if not self.preference:
            return args
        if self.job.train.objective != "dpo":
            return (*args, batch.sequence_ids)
        reference = batch.reference
        if reference is None:
            with torch.no_grad(), self._adapters_off():
                values = self.reference_runner.step(
                    *args, batch.sequence_ids, documents=self._documents(batch), reduce=False
                )
            reference = values.flatten(0, 1)  # (rows, slots) on the last stage's rank
        return (*args, batch.sequence_ids, reference)

    def reduce_and_clip(self) -> torch.Tensor:
        """Make gradients whole: finish the dp × cp sum started during the last backward (of
        losses already divided by the global batch's count: the mean gradient),
        align TP placements, sum tied embeddings across pipeline stages; then clip by the global
        norm and return it (a 0-d tensor: nothing here waits for the host). The dp × cp sum of
        local shards commutes with the other two, both sums; after it every dp and cp rank holds
        the same gradients, so the norm needs no reduction over them.

        Collectives, whatever the number of parameters: the dp × cp buckets' all-reduces (mostly
        already done), one all-reduce per mesh dim of ``Partial`` grads (tp), the tied pair's
        send/recv (pp), and the norm's scalar all-reduce over tp and over pp."""
        params = self.parameters()
        if self.grad_reducer is not None:
            self.grad_reducer.finish()
        if self.dims.tp > 1:
            align_grad_placements(params)
        if self.tied and self.dims.pp > 1 and self.tied_trainable:
            sum_tied_embedding_grads(self.parts, self.dims.group("pp"))
        groups = [self.dims.group(axis) for axis in ("tp", "pp") if getattr(self.dims, axis) > 1]
        return clip_grad_norm(params, self.job.train.max_grad_norm, groups=groups, norm_params=self._norm_params())

    def _norm_params(self) -> list[nn.Parameter]:
        """The parameters this rank counts in the global gradient norm: a tied weight split over
        two stages holds one gradient twice and is counted once; a plain (replicated) tensor
        under TP is counted on tp rank 0."""
        twice = self.tied and self.dims.pp > 1
        tp_rank = self.dims.coordinates()["tp_rank"]
        return [
            p
            for n, p in self.named_parameters()
            if not (twice and n == "lm_head.weight") and (isinstance(p, DTensor) or tp_rank == 0)
        ]

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


COMPILE_BACKENDS = {"cpu": "inductor", "cuda": "inductor", "neuron": "neuron"}
"""The ``torch.compile`` backend of ``train.compile`` by device (``neuron``: torch-neuronx's)."""


def compile_layers(parts: list[nn.Module], device: torch.device) -> None:
    """Compile every decoder layer of ``parts`` in place with ``nn.Module.compile`` (the layer's
    calls run the compiled forward; its parameter names, and so checkpoints, are unchanged).
    On neuron ``dynamic=False``: torch-neuronx refuses dynamic shapes and compiles a graph per
    input shape.

    Under TP the embedding's output is the result of a functional collective, an
    ``AsyncCollectiveTensor``; the first layer gets it as a plain tensor (:func:`_waited`): with
    that subclass as a compiled layer's input, torch 2.13 hands the eager redistribution behind
    it a plain tensor gradient where it expects a DTensor, and backward fails."""
    options = {"backend": COMPILE_BACKENDS[device.type]}
    if device.type == "neuron":
        options["dynamic"] = False
    for part in parts:
        if part.model.embed_tokens is not None:
            part.model.embed_tokens.register_forward_hook(_waited)
        for layer in part.model.layers.values():
            layer.compile(**options)


def _waited(module: nn.Module, inputs, output):
    """``output`` as a plain tensor once its collective is done (a forward hook). A copy, which
    autograd records: ``AsyncCollectiveTensor.wait()`` would return the inner tensor, cut off
    from the graph, and the embedding would get no gradient."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def use_tf32_on_cuda() -> None:
    """fp32 matmuls on CUDA's TF32 tensor cores (what the planner's fp32 peak assumes). Set with
    ``torch.backends.cuda.matmul.allow_tf32``, which leaves CPU matmuls alone, unlike
    ``torch.set_float32_matmul_precision("high")``, which in torch 2.13 also switches oneDNN's."""
    torch.backends.cuda.matmul.allow_tf32 = True


def build_engine(job: JobConfig, dims: ParallelDims, device: torch.device) -> Engine:
    """Build this rank's part of the model from ``job.model_path`` and its optimizer."""
    pc = job.parallel
    if device.type == "cuda":
        use_tf32_on_cuda()
    mesh = dims.mesh
    context = ContextShard(dims.cp, dims.coordinates()["cp_rank"], dims.group("cp")) if dims.cp > 1 else None
    config = load_config(job.model_path)
    pp_rank = mesh["pp"].get_local_rank()
    layout = {"pp": pc.pp, "virtual_stages": pc.virtual_stages, "schedule": pc.pipeline_schedule}
    stage_ids = stage_ids_for_rank(pp_rank, **layout)
    meta = build_meta_model(config)
    parts = build_stages(
        meta, config, pp_rank=pp_rank, layer_split=pc.layer_split, recompute_every=pc.activation_checkpointing, **layout
    )
    weights = HFWeights(job.model_path)
    lora = job.train.lora
    for part in parts:
        if lora is not None:
            add_lora(part, lora)
        if dims.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], sequence_parallel=pc.sequence_parallel)
        materialize(part, device)
        load_weights(part, weights, tied=bool(config.tie_word_embeddings), skip=is_adapter)
        if lora is not None:
            init_adapters(part, job.train.seed)
            freeze_base(part, lora, tied=bool(config.tie_word_embeddings))
        part.return_logits = False  # the last stage's loss takes the lm_head a chunk at a time
        part.context = context
        part.train()
    if job.train.compile:
        compile_layers(parts, device)
    runner = reference = None
    if dims.pp > 1:
        schedule = {"schedule": pc.pipeline_schedule, "num_microbatches": pc.num_microbatches}
        pp_group = mesh["pp"].get_group()
        losses = pipeline_loss(job, parts[-1])
        runner = PipelineRunner(parts, stage_ids, pc.num_stages, pp_group=pp_group, device=device, **schedule, **losses)
        reference = reference_runner(job, runner)
    kw = dict(parts=parts, stage_ids=stage_ids, runner=runner, reference_runner=reference)
    return Engine(job=job, dims=dims, device=device, config=config, **kw)
