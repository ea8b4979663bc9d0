"""Parallelism applied to the model's stages, one module per job:

* ``dtensor``: the DTensor helpers the others use (this rank's shard, the whole tensor, the
  global slice a shard covers, a gradient aligned to its parameter's placements);
* ``tensor``: tensor and sequence parallelism of a stage (Megatron-style sharding with DTensor,
  replicated KV heads when tp exceeds them);
* ``pipeline``: pipeline parallelism (which stages a rank holds, building them, running a
  ``torch.distributed.pipelining`` schedule);
* ``pipeline_losses``: what the last pipeline stage computes per microbatch, by objective (the
  token loss, the preference objectives' pair statistics, DPO under LoRA's reference pass);
* ``context``: context parallelism (each row's sequence cut into load-balanced shards over the
  cp ranks on the host; attention over the all-gathered keys and values, masked by global index
  and document);
* ``data_parallel``: averaging gradients over dp (dp × cp under context parallelism), bucket by
  bucket while backward runs (``GradReducer``);
* ``zero``: ZeRO-1, the optimizer state sharded over dp (dp × cp) (``Zero1Optimizer``);
* ``lora``: low-rank adapters on a stage's linear layers, laid out for tensor parallelism.

``neuron_parallel.engine`` composes them into one rank's training step."""
