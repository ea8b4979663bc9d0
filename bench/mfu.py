"""Part 4 of ``train_throughput.py``: MFU of a ~1B Llama (hidden 2048, 16 layers, 32 heads, 8 KV
heads, intermediate 5632, vocab 32000, seq 2048; 0.85 B parameters) as one neuron_parallel
``CausalLMStage`` under bf16 autocast with fp32 master weights, clipping and the engine's AdamW,
FLOPs/token = 6 N_non_embedding + 12 L H Q T (N counts every parameter but the input embedding
table), peak 989 TFLOP/s dense bf16 (NVIDIA H100 SXM and H200 datasheets). Without CUDA it is
reported as skipped.
"""

from __future__ import annotations

import time

from bench_util import median  # bench/ is on sys.path

# ~1B Llama: hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 5632, vocab 32000.
MFU_SHAPE = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=5632,
    vocab_size=32000,
)
MFU_SEQ = 2048
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # NVIDIA H100 SXM / H200 datasheets, dense bf16 (no sparsity)


def run_mfu(
    device_type: str = "cuda",
    shape: dict | None = None,
    seq: int = MFU_SEQ,
    mbs: int = 8,
    steps: int = 10,
    warmup: int = 3,
    seed: int = 0,
    betas: tuple[float, float] = (0.9, 0.95),
    max_grad_norm: float = 1.0,
) -> dict:
    """Median step time, tokens/s, achieved TFLOP/s and MFU of one ``CausalLMStage`` on one device."""
    import torch
    from transformers import LlamaConfig

    from neuron_parallel.models.causal_lm import CausalLMStage, build_meta_model, causal_lm_loss, materialize
    from neuron_parallel.optim import clip_grad_norm, param_groups

    shape = dict(MFU_SHAPE if shape is None else shape)
    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    config = LlamaConfig(**shape, max_position_embeddings=seq, tie_word_embeddings=False, rms_norm_eps=1e-5)
    L = config.num_hidden_layers
    stage = CausalLMStage(build_meta_model(config), range(L), first=True, last=True)
    materialize(stage, device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for _name, prm in stage.named_parameters():
            if prm.dim() >= 2:
                prm.normal_(0.0, config.initializer_range)
            else:
                prm.fill_(1.0)
    stage.train()
    named = list(stage.named_parameters())
    # As Engine builds it for tp == 1.
    opt = torch.optim.AdamW(param_groups(named, 0.0), lr=1e-4, betas=betas, eps=1e-8, foreach=True)
    n_total = sum(prm.numel() for prm in stage.parameters())
    n_embed = stage.model.embed_tokens.weight.numel()
    n_nonembed = n_total - n_embed
    H, Q = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    flops_per_token = 6 * n_nonembed + 12 * L * H * Q * seq

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    g = torch.Generator(device="cpu").manual_seed(seed)
    times = []
    for i in range(warmup + steps):
        tokens = torch.randint(0, config.vocab_size, (mbs, seq + 1), generator=g).to(device)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = causal_lm_loss(stage(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        clip_grad_norm([prm for _, prm in named], max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step = median(times)
    tps = mbs * seq / step
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    out = {
        "device": name,
        "params": n_total,
        "params_non_embedding": n_nonembed,
        "flops_per_token": flops_per_token,
        "mbs": mbs,
        "seq": seq,
        "step_time_s": step,
        "tokens_per_s": tps,
        "achieved_tflops": tps * flops_per_token / 1e12,
        "peak_tflops": peak / 1e12 if peak else None,
        "mfu": tps * flops_per_token / peak if peak else None,
    }
    if device.type == "cuda":
        out["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out
