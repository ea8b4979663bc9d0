"""A tiny world that needs no network: a byte-level BPE tokenizer trained on the text of
Python's own documentation (``pydoc_data.topics``), a small Llama-architecture model with GQA
built from a config, and that text as a JSONL corpus.

Both are saved as ordinary Hugging Face directories, so ``model.name_or_path`` points at a local
path exactly as a Hub id would for a real user.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def corpus_documents() -> list[str]:
    """The topics of Python's bundled documentation, one document each (~465 KB of English)."""
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)]


def train_tokenizer(documents: list[str], vocab_size: int = 2048):
    """Train a byte-level BPE tokenizer in about a second and wrap it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        model_max_length=TINY_MODEL_SHAPE["max_position_embeddings"],
    )


def make_tiny_world(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 2048, **shape) -> dict[str, str]:
    """Write ``out_dir/model`` (config, weights, tokenizer) and ``out_dir/corpus.jsonl``.

    ``shape`` overrides entries of ``TINY_MODEL_SHAPE`` (e.g. ``num_hidden_layers=8``).
    Returns the two paths.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    docs = corpus_documents()
    corpus = out / "corpus.jsonl"
    with corpus.open("w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")

    tokenizer = train_tokenizer(docs, vocab_size=vocab_size)
    tokenizer.save_pretrained(model_dir)
    config = LlamaConfig(
        **{**TINY_MODEL_SHAPE, **shape},
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=32,
    )
    model.save_pretrained(model_dir)
    return {"model": str(model_dir), "corpus": str(corpus)}
