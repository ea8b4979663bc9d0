"""The numbers that size a training run, shared by the memory and step-time models: a Llama
model's shape (``ModelShape``, read from config.json), the parameters one pipeline stage holds on
a tp rank (``stage_params``), the bytes per parameter and activation element of each precision
mode (``STATES``, ``model_states_bytes``), which parameters ZeRO-1 gives each dp rank
(``zero_partition``) and the dp reduction's buckets (``max_bucket``). Nothing here imports torch."""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes per parameter and per activation element of one precision mode."""

    param: int
    grad: int
    sharded: int  # optimizer state (and fp32 master weights) that ZeRO-1 splits over dp
    act: int  # matmul outputs
    resid: int  # the residual stream (fp32 under autocast: fp32 params make the adds fp32)
    cast_cache: int = 0  # autocast's low-precision weight copies, alive through the step
    autocast: bool = False  # each projection casts (and saves) its own low-precision input copy


STATES = {
    "fp32": StateBytes(param=4, grad=4, sharded=8, act=4, resid=4),
    "bf16": StateBytes(param=2, grad=2, sharded=12, act=2, resid=2),
    "bf16_autocast": StateBytes(param=4, grad=4, sharded=8, act=2, resid=4, cast_cache=2, autocast=True),
}


HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
}
"""The config.json names of the ``ModelShape`` fields named otherwise there."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a Llama-family config.json that size a training run."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int
    tie_word_embeddings: bool = False
    name: str = ""

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a config.json path (or its directory), a dict, or a ``PretrainedConfig``; weights
        are never read."""
        if isinstance(config, ModelShape):
            return config
        if isinstance(config, (str, Path)):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"no config.json at {config}; pass a model directory, its config.json or a dict")
            name, config = str(config), json.loads(path.read_text())
        else:
            name = (
                getattr(config, "name_or_path", "") if not isinstance(config, dict) else config.get("_name_or_path", "")
            )
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
            if get(k) is None
        ]
        if missing:
            raise ValueError(f"model config lacks {missing}; the planner needs a Llama-family config.json")
        heads = get("num_attention_heads")
        return cls(
            hidden_size=get("hidden_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads,
            intermediate_size=get("intermediate_size"),
            vocab_size=get("vocab_size"),
            head_dim=get("head_dim") or get("hidden_size") // heads,
            # Llama, Mistral and Qwen configs default to untied when the key is absent.
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            name=str(name or ""),
        )

    def as_config(self) -> SimpleNamespace:
        """Attribute view with Hugging Face names (for ``neuron_parallel.planning.layout.check_layout``)."""
        ours = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")
        ours += ("head_dim", "tie_word_embeddings")
        return SimpleNamespace(**{HF_NAMES.get(name, name): getattr(self, name) for name in ours})

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h

    @property
    def num_parameters(self) -> int:
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + embed + self.hidden_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as in the PaLM paper's MFU (Chowdhery et al. 2022, appendix B):
        ``6·N_non_embedding + 12·L·H·Q·T`` (N counts every matmul weight, the lm_head included, but
        not the input embedding lookup)."""
        n = self.num_layers * self.layer_params + self.vocab_size * self.hidden_size + self.hidden_size
        return 6 * n + 12 * self.num_layers * self.num_heads * self.head_dim * seq_len


def local_kv_heads(kv_heads: int, tp: int) -> int:
    """KV heads one tp rank holds: ``kv/tp``, or 1 replicated head when tp > kv."""
    return max(1, kv_heads // tp)


def stage_params(shape: ModelShape, tp: int, n_layers: int, first: bool, last: bool) -> list[tuple[int, bool]]:
    """(local numel, is_matrix) of every parameter one stage holds on a tp rank, in the order of
    ``CausalLMStage.named_parameters`` (embedding, layers, final norm, lm_head)."""
    h, d, i, V = shape.hidden_size, shape.head_dim, shape.intermediate_size, shape.vocab_size
    q, kv = shape.num_heads * d // tp, local_kv_heads(shape.num_kv_heads, tp) * d
    layer = [
        (q * h, True),
        (kv * h, True),
        (kv * h, True),
        (h * q, True),
        (i // tp * h, True),
        (i // tp * h, True),
        (h * i // tp, True),
        (h, False),
        (h, False),
    ]
    out = [(V // tp * h, True)] if first else []
    out += layer * n_layers
    if last:
        out.append((h, False))
        if not (first and shape.tie_word_embeddings):  # one module holding both: one Parameter
            out.append((V // tp * h, True))
    return out


BUCKET_BYTES = 32 << 20
"""The gradient bucket of the dp reduction (``GradReducer``'s default, defined here, where the
torch-free memory model can read it). Smaller buckets start earlier in backward (more overlap)
but are more collectives; DDP's default is 25 MiB."""


def model_states_bytes(num_params: float, *, dp: int = 1, zero_1: bool = False, precision: str = "bf16") -> float:
    """Parameter + gradient + optimizer bytes for ``num_params`` on one rank (ZeRO paper formula)."""
    st = STATES[precision]
    return num_params * (st.param + st.grad + st.cast_cache) + num_params * st.sharded / (dp if zero_1 else 1)


@lru_cache(maxsize=4096)
def zero_partition(sizes: tuple[tuple[int, bool], ...], dp: int) -> tuple[tuple[int, int], ...]:
    """Per dp rank (owned numel, largest owned numel) under ``ZeroRedundancyOptimizer``'s greedy
    placement: per param group (matrices, then vectors), largest first, onto the least-loaded
    rank (lowest index on ties), the loads carried across groups."""
    loads = [0] * dp
    largest = [0] * dp
    for group in ([n for n, m in sizes if m], [n for n, m in sizes if not m]):
        heap = [(load, r) for r, load in enumerate(loads)]
        heapq.heapify(heap)
        for n in sorted(group, reverse=True):
            load, r = heapq.heappop(heap)
            loads[r] = load + n
            largest[r] = max(largest[r], n)
            heapq.heappush(heap, (loads[r], r))
    return tuple(zip(loads, largest))


def max_bucket(sizes: list[int], cap: int = BUCKET_BYTES) -> int:
    """The bytes the dp reduction holds beyond the gradients (grad sizes in bytes, in order): its
    largest flat bucket, of up to ``cap`` (a larger grad is its own bucket). ``GradReducer`` (its
    buckets cut by ``plan_buckets``: from the last parameter back, and at dtype changes) copies
    one bucket at a time into a new flat buffer that replaces the bucket's gradients, which are
    released as soon as it is made, so one bucket at a time is more than the gradients."""
    buckets, size = [], 0
    for n in sizes:
        if size and size + n > cap:
            buckets.append(size)
            size = 0
        size += n
    buckets.append(size)
    return max(buckets)
