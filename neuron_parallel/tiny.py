"""A tiny world that needs no network: a byte-level BPE tokenizer trained on the text of
Python's own documentation (``pydoc_data.topics``), a small Llama-architecture model with GQA
built from a config, a small Qwen2-architecture one with tied embeddings, that text as a JSONL
corpus, and the same text as a local dataset folder laid out like the Hub's ``wikitext`` (two
configs declared in its README metadata, parquet splits of one paragraph per row). For
supervised fine-tuning it adds a generated multi-turn chat set and an alpaca-style instruction
set built from the same topics; the tokenizer knows the special tokens of the two chat templates
in ``neuron_parallel/chat_templates`` (ChatML and Llama 3 style), and the Qwen2 model carries the ChatML
one as an instruct model does, while the Llama model has none, as a base model.

Both are saved as ordinary Hugging Face directories, so ``model.name_or_path`` points at a local
path exactly as a Hub id would for a real user.
"""

from __future__ import annotations

import json
import random
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
CHAT_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
"""Special tokens of the ChatML and Llama 3 style templates, besides ``<|endoftext|>`` and ``<|pad|>``."""
TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
"""The chat templates shipped with the package (ChatML and Llama 3 style); ``make_tiny_world``
copies them to ``out_dir/chat_templates`` for configs to name."""


def corpus_documents() -> list[str]:
    """The topics of Python's bundled documentation, one document each (~465 KB of English)."""
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)]


def train_tokenizer(documents: list[str], vocab_size: int = 2048):
    """Train a byte-level BPE tokenizer in about a second and wrap it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|pad|>", *CHAT_TOKENS]
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
        extra_special_tokens=list(CHAT_TOKENS),
        model_max_length=TINY_MODEL_SHAPE["max_position_embeddings"],
    )


def make_tiny_world(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 2048, **shape) -> dict[str, str]:
    """Write ``out_dir/model`` (config, weights, tokenizer) and ``out_dir/corpus.jsonl``.

    ``shape`` overrides entries of ``TINY_MODEL_SHAPE`` (e.g. ``num_hidden_layers=8``).
    Also writes ``out_dir/qwen2`` (Qwen2 architecture, tied embeddings, same tokenizer with the
    ChatML chat template), ``out_dir/wikitext``, ``out_dir/chat.jsonl`` (``chat_rows``) and
    ``out_dir/alpaca.jsonl`` (``alpaca_rows``), ``out_dir/preference.jsonl`` (``preference_rows``)
    and ``out_dir/chat_templates`` (a copy of
    ``TEMPLATES``). Returns the paths by name (``model``, ``corpus``, ``qwen2``, ``wikitext``,
    ``chat``, ``alpaca``, ``chat_templates``, ``preference``).
    """
    from transformers import LlamaConfig, Qwen2Config

    out = Path(out_dir)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    docs = corpus_documents()
    corpus = out / "corpus.jsonl"
    with corpus.open("w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")

    tokenizer = train_tokenizer(docs, vocab_size=vocab_size)
    shape = {**TINY_MODEL_SHAPE, **shape}
    _save_model(LlamaConfig(**shape), tokenizer, model_dir, seed)
    tokenizer.chat_template = (TEMPLATES / "chatml.jinja").read_text()  # an instruct model's tokenizer
    _save_model(Qwen2Config(**{**shape, "tie_word_embeddings": True}), tokenizer, out / "qwen2", seed)
    tokenizer.chat_template = None
    write_wikitext_folder(docs, out / "wikitext")
    (out / "chat_templates").mkdir(exist_ok=True)
    for template in TEMPLATES.glob("*.jinja"):
        (out / "chat_templates" / template.name).write_text(template.read_text())
    _write_jsonl(out / "chat.jsonl", [{"messages": m} for m in chat_rows(seed=seed)])
    _write_jsonl(out / "alpaca.jsonl", alpaca_rows(seed=seed))
    _write_jsonl(out / "preference.jsonl", preference_rows(seed=seed))
    return {
        "model": str(model_dir),
        "corpus": str(corpus),
        "qwen2": str(out / "qwen2"),
        "wikitext": str(out / "wikitext"),
        "chat": str(out / "chat.jsonl"),
        "alpaca": str(out / "alpaca.jsonl"),
        "chat_templates": str(out / "chat_templates"),
        "preference": str(out / "preference.jsonl"),
    }


def make_tiny_llama(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 2048, **shape) -> str:
    """Only the tiny Llama of ``make_tiny_world`` (config, weights and its tokenizer) in ``out_dir``,
    ``shape`` overriding entries of ``TINY_MODEL_SHAPE``; returns the directory."""
    from transformers import LlamaConfig

    tokenizer = train_tokenizer(corpus_documents(), vocab_size=vocab_size)
    _save_model(LlamaConfig(**{**TINY_MODEL_SHAPE, **shape}), tokenizer, Path(out_dir), seed)
    return str(out_dir)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _topics() -> list[tuple[str, list[str]]]:
    """Each pydoc topic's name (as words) and its text as a list of words."""
    from pydoc_data.topics import topics

    return [(key.replace("-", " ").replace("_", " "), topics[key].split()) for key in sorted(topics)]


SYSTEM_PROMPTS = (
    "You are a concise assistant that answers questions about Python.",
    "Answer from the Python language reference.",
    "You are a helpful assistant.",
)
QUESTIONS = (
    "What does the Python documentation say about {}?",
    "Explain {} briefly.",
    "Tell me more about {}.",
    "How does {} work in Python?",
    "Can you go on about {}?",
)


def chat_rows(num_rows: int = 300, *, seed: int = 0) -> list[list[dict]]:
    """Conversations about the pydoc topics: about a third open with a system prompt, each has 1 to
    3 user/assistant exchanges, and the answers are consecutive passages of the topic of 4 to 40
    words. Deterministic for a given seed."""
    rng = random.Random(seed)
    topics = _topics()
    rows = []
    for _ in range(num_rows):
        name, words = rng.choice(topics)
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.35 else []
        at = 0
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(4, 40)
            answer = " ".join(words[at : at + n]) or name
            at += n
            messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(name)})
            messages.append({"role": "assistant", "content": answer})
        rows.append(messages)
    return rows


def alpaca_rows(num_rows: int = 200, *, seed: int = 0) -> list[dict]:
    """Alpaca-style rows (instruction, input, output) from the pydoc topics: half continue a
    passage given as input, half have an empty input. Deterministic for a given seed."""
    rng = random.Random(seed + 1)
    topics = _topics()
    rows = []
    for i in range(num_rows):
        name, words = rng.choice(topics)
        lead, n = rng.randint(5, 30), rng.randint(5, 80)
        if i % 2:
            rows.append({"instruction": f"Summarise what the documentation says about {name}.", "input": ""})
            rows[-1]["output"] = " ".join(words[:n]) or name
        else:
            rows.append({"instruction": "Continue this passage from the Python documentation."})
            rows[-1].update(input=" ".join(words[:lead]) or name, output=" ".join(words[lead : lead + n]) or name)
    return rows


PREFERRED_ANSWER = "See the Python documentation."
"""The chosen completion of every generated preference pair (``preference_rows``)."""


def preference_rows(num_rows: int = 200, *, seed: int = 0) -> list[dict]:
    """Preference pairs (prompt, chosen, rejected) from the pydoc topics: the prompt a question
    about a topic, the chosen completion always :data:`PREFERRED_ANSWER`, the rejected one 3 to 8
    random words of the topic: a preference a tiny model learns in a few dozen steps.
    Deterministic for a given seed."""
    rng = random.Random(seed + 2)
    topics = _topics()
    rows = []
    for _ in range(num_rows):
        name, words = rng.choice(topics)
        rejected = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) or name
        rows.append({"prompt": rng.choice(QUESTIONS).format(name), "chosen": PREFERRED_ANSWER, "rejected": rejected})
    return rows


def _save_model(config, tokenizer, model_dir: Path, seed: int) -> None:
    """A randomly initialised causal LM of ``config`` with ``tokenizer``, saved as a HF directory."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.update(dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, max_new_tokens=32, **ids)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(model_dir)
    model.save_pretrained(model_dir)


WIKITEXT_CONFIGS = ("wikitext-2-raw-v1", "wikitext-103-raw-v1")


def write_wikitext_folder(docs: list[str], out: str | Path) -> Path:
    """A dataset folder laid out like the Hub's ``wikitext``: ``<config>/<split>-00000-of-00001.parquet``
    for each of ``WIKITEXT_CONFIGS`` and the train/validation/test splits (one paragraph per row,
    every 10th document to validation, every 10th + 1 to test; the 103 config repeats the
    training text 3 times), with the configs declared in README.md's metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    splits = {"train": [], "validation": [], "test": []}
    for i, doc in enumerate(docs):
        split = "validation" if i % 10 == 0 else "test" if i % 10 == 1 else "train"
        splits[split] += [p.strip() + "\n" for p in doc.split("\n\n") if p.strip()]
    meta = ["---", "configs:"]
    for name, repeat in zip(WIKITEXT_CONFIGS, (1, 3)):
        meta += [f"- config_name: {name}", "  data_files:"]
        for split, rows in splits.items():
            (out / name).mkdir(parents=True, exist_ok=True)
            rows = rows * (repeat if split == "train" else 1)
            pq.write_table(pa.table({"text": rows}), out / name / f"{split}-00000-of-00001.parquet")
            meta += [f"  - split: {split}", f"    path: {name}/{split}-*"]
    (out / "README.md").write_text("\n".join([*meta, "---", "# wikitext (a local stand-in built from pydoc text)", ""]))
    return out
