"""Parallelism applied to the model's stages, one module per job:

* ``dtensor``: the DTensor helpers the others use (this rank's shard, the whole tensor, the
  global slice a shard covers, a gradient aligned to its parameter's placements);
* ``tensor``: tensor and sequence parallelism of a stage (Megatron-style sharding with DTensor,
  replicated KV heads when tp exceeds them);
* ``pipeline``: pipeline parallelism (which stages a rank holds, building them, running a
  ``torch.distributed.pipelining`` schedule);
* ``data_parallel``: averaging gradients over dp, bucket by bucket while backward runs
  (``GradReducer``);
* ``zero``: ZeRO-1, the optimizer state sharded over dp (``Zero1Optimizer``);
* ``lora``: low-rank adapters on a stage's linear layers, laid out for tensor parallelism.

``neuron_parallel.engine`` composes them into one rank's training step."""
