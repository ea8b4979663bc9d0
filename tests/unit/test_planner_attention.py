"""The planner's attention and loss memory (``neuron_parallel.planning.attention``, used by
``neuron_parallel.planning.memory``) against the tensor bytes a stage's forward and backward
really take on CPU, measured from the allocator with ``neuron_parallel.memprof``, at S = 2048
and 4096 on a small Llama (2 layers, 4 heads, 2 KV heads, a 32k vocabulary so that the loss
runs in several chunks).

* the explicit-mask path (CPU, rows packed from documents): the bytes a packed micro-batch holds
  from forward to backward beyond the same micro-batch on the causal path;
* the fp32 scores path (neuron, modelled on torch's own decomposition): the same, with
  scaled-dot-product attention forced onto torch's math backend, against the causal flash path;
* the chunked loss: nothing of the logits held from forward to backward, and at backward the
  buffers of one chunk and the lm_head's weight gradient;
* context parallelism's blocked attention (``neuron_parallel.parallel.context.blocked_attention``),
  on its own: nothing but its output held from forward to backward, and the peak of its
  backward, on CPU's fused kernel and on torch's math decomposition (neuron's path)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from neuron_parallel.memprof import TensorMemoryProfile
from neuron_parallel.models.causal_lm import CausalLMStage, build_meta_model, materialize
from neuron_parallel.parallel.context import BlockedMask, blocked_attention, shard_index
from neuron_parallel.planning.attention import (
    attention_bytes,
    attention_path,
    block_size_advice,
    blocked_work,
    logits_bytes,
)
from neuron_parallel.planning.memory import STATES, ModelShape, stage_memory

LAYERS = 2
MiB = 1 << 20


@pytest.fixture(scope="module")
def stage():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=512,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    stage = CausalLMStage(build_meta_model(config), range(LAYERS), first=True, last=True)
    materialize(stage, torch.device("cpu"))
    with torch.no_grad():
        for p in stage.parameters():
            p.normal_(0, 0.02)
    stage.return_logits = False  # the engine's way: the loss takes the lm_head a chunk at a time
    return stage.train()


def measure(stage, seq: int, packed: bool = False, autocast: bool = False, loss: bool = False) -> dict[str, float]:
    """Tensor bytes at the end of the stage's forward (and with ``loss``, at the end of the loss's
    forward, and the peak of the backward) for one row of ``seq`` tokens, two documents when
    ``packed``."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, stage.config.vocab_size, (1, seq), generator=g)
    labels = torch.randint(0, stage.config.vocab_size, (1, seq), generator=g)
    positions = torch.cat([torch.arange(seq // 3), torch.arange(seq - seq // 3)])[None] if packed else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), TensorMemoryProfile() as probe:
        with torch.profiler.record_function("phase:forward"):
            hidden = stage(ids, positions)
        if loss:
            with torch.profiler.record_function("phase:loss"):
                total = stage.loss(hidden, labels)
            with torch.profiler.record_function("phase:backward"):
                total.backward()
    del hidden
    stage.zero_grad(set_to_none=True)
    out = {}
    for _, end, name in probe.ranges:
        out[name] = [total for t, total in probe.events if t <= end][-1]  # bytes allocated at the phase's end
    if loss:
        out["backward_peak"] = probe.peak()["phases"]["backward"]
    return out


_CAUSAL: dict = {}


def causal_forward(stage, seq: int, autocast: bool = False) -> float:
    """Bytes at the end of the causal path's forward (once per sequence length and precision)."""
    if (seq, autocast) not in _CAUSAL:
        _CAUSAL[seq, autocast] = measure(stage, seq, autocast=autocast)["forward"]
    return _CAUSAL[seq, autocast]


def shape_of(stage) -> ModelShape:
    return ModelShape.from_config(stage.config)


@pytest.mark.parametrize("seq", [2048, 4096])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_explicit_mask_path_holds_what_the_planner_counts(stage, seq, autocast):
    st = STATES["bf16_autocast" if autocast else "fp32"]
    assert attention_path("cpu", True, seq, 32) == "mask" and attention_path("cpu", False, seq, 32) == "flash"
    cost = attention_bytes(shape_of(stage), 1, seq, st, "mask")
    predicted = seq * (LAYERS * cost["layer"] + cost["mask"])  # one row: seq tokens
    measured = measure(stage, seq, packed=True, autocast=autocast)["forward"] - causal_forward(stage, seq, autocast)
    print(
        f"mask path S={seq} {'bf16' if autocast else 'fp32'}: measured {measured / MiB:.2f} MiB, "
        f"predicted {predicted / MiB:.2f} MiB"
    )
    assert abs(measured / predicted - 1) <= 0.02, (measured, predicted)


@pytest.mark.parametrize("seq", [2048, 4096])
def test_scores_path_holds_what_torchs_decomposed_attention_holds(stage, seq):
    """Neuron's path outside its flash kernel, as torch's math backend computes it on CPU."""
    st = STATES["fp32"]
    assert attention_path("neuron", True, seq, 32) == "scores" and attention_path("neuron", False, seq, 32) == "flash"
    assert (
        attention_path("neuron", False, seq + 100, 32) == "scores"
        and attention_path("neuron", False, seq, 192) == "scores"
    )
    cost = attention_bytes(shape_of(stage), 1, seq, st, "scores")
    predicted = seq * LAYERS * cost["layer"]
    flash = causal_forward(stage, seq)
    with sdpa_kernel(SDPBackend.MATH):
        measured = measure(stage, seq, packed=True)["forward"] - flash
    print(f"scores path S={seq}: measured {measured / MiB:.2f} MiB, predicted {predicted / MiB:.2f} MiB")
    assert abs(measured / predicted - 1) <= 0.02, (measured, predicted)


@pytest.mark.parametrize("seq", [2048, 4096])
def test_chunked_loss_holds_one_chunk_and_nothing_until_backward(stage, seq):
    shape, st = shape_of(stage), STATES["fp32"]
    chunk_logits, chunked = logits_bytes(shape, 1, seq)
    assert chunked and chunk_logits < seq * shape.vocab_size * 4
    at = measure(stage, seq, loss=True)
    assert at["loss"] - at["forward"] <= 1 * MiB  # no logits, no log-softmax kept for backward
    # The planner at the start of backward: three fp32 chunk buffers, and the lm_head's gradient
    # (its ``grads`` without accumulation).
    kw = dict(tp=1, pp=1, dp=1, zero_1=False, sp=False, recompute=0, micro_batch=1, seq_len=seq, num_microbatches=1)
    kw.update(schedule="1f1b", virtual_stages=1, precision="fp32", pp_rank=0, layers=[LAYERS])
    mem = stage_memory(shape, grad_accum=1, **kw)
    head_grad = (shape.vocab_size * shape.hidden_size + shape.hidden_size) * st.grad
    assert mem.phase == "backward" and mem.loss == 3 * chunk_logits and mem.grads == head_grad
    predicted = mem.loss + mem.grads
    measured = at["backward_peak"] - at["loss"]
    print(
        f"chunked loss S={seq}: measured {measured / MiB:.2f} MiB at backward, predicted {predicted / MiB:.2f} MiB "
        f"(unchunked: {(3 * seq * shape.vocab_size * 4 + head_grad) / MiB:.0f} MiB)"
    )
    assert abs(measured / predicted - 1) <= 0.03, (measured, predicted)


@pytest.mark.parametrize("documents", [False, True], ids=["stream", "documents"])
@pytest.mark.parametrize("path", ["mask_blocks", "score_blocks"])
def test_blocked_attention_holds_what_the_planner_counts(path, documents):
    """Two rows of 4096 tokens on cp rank 0 of 2 (2048 local queries: 4 blocks of 512), fp32, the
    K/V of the whole row as gathered, q, k and v made by an op as in a layer. ``mask_blocks`` runs
    CPU's fused kernel, ``score_blocks`` torch's math decomposition (fp32 scores, neuron's way)."""
    rows, heads, kv_heads, head_dim, seq, cp = 2, 4, 2, 32, 4096, 2
    config = dict(model_type="llama", hidden_size=heads * head_dim, num_hidden_layers=1, vocab_size=32000)
    config.update(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=512)
    shape, local = ModelShape.from_config(config), seq // cp
    assert attention_path("cpu" if path == "mask_blocks" else "neuron", documents, seq, head_dim, cp) == path
    g = torch.Generator().manual_seed(0)
    leaves = [
        torch.randn(rows, h, n, head_dim, generator=g, requires_grad=True) for h, n in ((4, local), (2, seq), (2, seq))
    ]
    q, k, v = (t * 1 for t in leaves)
    docs = (torch.arange(seq) // 1000).expand(rows, seq).contiguous() if documents else None
    mask = BlockedMask(torch.from_numpy(shard_index(seq, cp, 0)), seq, docs, torch.float32)
    with sdpa_kernel(SDPBackend.MATH if path == "score_blocks" else SDPBackend.FLASH_ATTENTION):
        with TensorMemoryProfile() as probe:
            with torch.profiler.record_function("phase:start"):  # the allocator's running total here
                marker = torch.zeros(1024)
            with torch.profiler.record_function("phase:forward"):
                out = blocked_attention(q, k, v, mask)
            grad = torch.randn_like(out)
            with torch.profiler.record_function("phase:backward"):
                out.backward(grad)
    bounds = {name: (start, end) for start, end, name in probe.ranges}

    def allocated(at: int) -> int:
        return [total for t, total in probe.events if t <= at][-1]

    held = allocated(bounds["forward"][1]) - allocated(bounds["start"][1])
    assert held == out.numel() * 4 and marker.numel()  # the output; nothing of the blocks
    before = allocated(bounds["backward"][0])
    measured = probe.peak()["phases"]["backward"] - before
    predicted = rows * local * blocked_work(shape, 1, seq, STATES["fp32"], path, cp, documents, rows)
    print(f"{path} {documents=}: backward holds {measured / MiB:.2f} MiB, predicted {predicted / MiB:.2f} MiB")
    assert abs(measured / predicted - 1) <= 0.03, (measured, predicted)


def test_block_size_advice_on_neuron_is_a_note():
    assert block_size_advice("cpu", True, 1000) is None and block_size_advice("cuda", True, 1000) is None
    assert block_size_advice("neuron", False, 4096, 128) is None
    assert "a multiple of 512 (e.g. 1024)" in block_size_advice("neuron", False, 1000)
    assert "head_dim=256" in block_size_advice("neuron", False, 4096, 256)
    assert "rows packed from several documents" in block_size_advice("neuron", True, 4096, 128)
