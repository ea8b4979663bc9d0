"""The training data's section of the run configuration (``data``): where the examples come from,
how each is rendered and masked, and how examples become rows. Part of the vocabulary of
``neuron_parallel.config`` (which re-exports :class:`DataConfig`), kept in its own module for its
size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from .utils import check_choice

DataFormat = Literal["text", "chat", "instruction", "prompt_completion", "preference"]


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The training data, how each example is rendered and masked, and how examples become rows."""

    source: str | list[str] = ".tiny/corpus.jsonl"
    """Local .txt/.jsonl/.parquet file(s) or folder, a Hub dataset name, or a local folder laid out
    like a Hub dataset (configs declared in its README metadata). With data.weights, a list whose
    entries are separate sources to mix."""
    text_field: str = "text"
    """Column holding the text (format text)."""
    config: str | None = None
    """Configuration of a Hub dataset or dataset folder (``load_dataset``'s name), e.g.
    wikitext-2-raw-v1; needed when it declares several. Applies to every source."""
    split: str = "train"
    """Split to read from a Hub dataset or dataset folder."""
    revision: str | list[str | None] | None = None
    """Revision (branch, tag or commit) of a Hub dataset data.source; with data.weights a list, one
    per entry of data.source (null for a local one). Unset: the newest commit. The preflight step
    resolves it to a commit, which the run records; data.eval_source is read at the revision of
    the same Hub dataset in data.source, else at its newest commit."""
    block_size: int = 128
    """Tokens per training sequence."""
    cache_dir: str = ".runs/datasets"
    """Where tokenized datasets are kept, keyed by fingerprint."""
    format: DataFormat = "text"
    """text (raw documents), chat (a column of messages), instruction (instruction / input /
    response columns, alpaca or dolly style), prompt_completion (prompt and completion columns) or
    preference (prompt, chosen and rejected columns, for train.objective dpo, simpo or orpo)."""
    messages_field: str = "messages"
    """Column holding each conversation as a list of {role, content} (format chat); roles are
    system, user, assistant and tool."""
    prompt_field: str | None = None
    """Column of the instruction (format instruction; default instruction) or of the prompt
    (formats prompt_completion and preference; default prompt)."""
    input_field: str | None = None
    """Column of the optional context of an instruction (format instruction); default input
    (alpaca) or context (dolly), whichever exists."""
    response_field: str | None = None
    """Column of the response (format instruction; default output (alpaca) or response (dolly))
    or of the completion (format prompt_completion; default completion)."""
    chosen_field: str = "chosen"
    """Column of the preferred completion of each pair (format preference): a string, or a list of
    chat messages (the assistant turn(s))."""
    rejected_field: str = "rejected"
    """Column of the dispreferred completion of each pair (format preference), like
    data.chosen_field."""
    chat_template: str | None = None
    """Path of a Jinja chat template file used instead of the tokenizer's own, e.g.
    .tiny/chat_templates/llama3.jinja; needed for chat data when the tokenizer has none."""
    train_on_prompt: bool = False
    """Put loss on every token; false puts it only on assistant turns (chat, every one of them)
    and on responses and completions, masking system, user and tool turns and prompts."""
    packing: bool | None = None
    """None: the format's default (text: the stream, documents concatenated with EOS and cut
    into rows with plain causal attention; other formats: true). true: whole examples packed
    greedily into rows, attention and positions restarting at each one. false: one example per
    row, padded."""
    weights: list[float] | None = None
    """Mixing weights, one per entry of data.source (a list of separate sources), e.g. [3, 1];
    examples are interleaved with these probabilities until the first source runs out."""
    seed: int = 0
    """Seeds the mixing of weighted sources and the eval hold-out (data.eval_fraction)."""
    eval_source: str | list[str] | None = None
    """Where evaluation examples come from (read like data.source); default data.source when
    data.eval_split is set."""
    eval_split: str | None = None
    """Split of the evaluation examples, e.g. validation of the same dataset folder or Hub
    dataset; default data.split when data.eval_source is set."""
    eval_fraction: float = 0.0
    """Hold this fraction of the training examples out for evaluation (chosen by data.seed,
    before packing); 0 holds none. Not together with data.eval_source or data.eval_split."""

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"data.block_size must be >= 2, got {self.block_size}")
        check_choice("data", "format", self.format, get_args(DataFormat))
        if self.format != "instruction" and self.input_field is not None:
            raise ValueError(
                f"data.input_field applies to data.format=instruction only (format is {self.format}); remove it"
            )
        if self.format in ("text", "chat"):
            for name in ("prompt_field", "response_field"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"data.{name} applies to data.format instruction or prompt_completion (format is "
                        f"{self.format}); remove it or set data.format"
                    )
        if self.format == "preference" and self.response_field is not None:
            raise ValueError(
                "data.response_field does not apply to data.format=preference; name the completions with "
                "data.chosen_field and data.rejected_field"
            )
        if self.format != "preference" and (self.chosen_field, self.rejected_field) != ("chosen", "rejected"):
            raise ValueError(
                f"data.chosen_field and data.rejected_field apply to data.format=preference only (format is "
                f"{self.format}); remove them or set data.format: preference"
            )
        if self.chat_template is not None and not Path(self.chat_template).expanduser().is_file():
            raise ValueError(
                f"data.chat_template={self.chat_template!r} is not a file; give the path of a Jinja chat template, "
                "e.g. one of neuron_parallel/chat_templates/, or remove it to use the tokenizer's own"
            )
        self._check_weights()
        self._check_revision()
        self._check_eval()

    def _check_weights(self) -> None:
        if self.weights is None:
            return
        if isinstance(self.source, str) or len(self.source) != len(self.weights):
            count = 1 if isinstance(self.source, str) else len(self.source)
            raise ValueError(
                f"data.weights has {len(self.weights)} entries but data.source has {count}; give data.source "
                "as a list with one source per weight, or remove data.weights"
            )
        if not all(w > 0 and math.isfinite(w) for w in self.weights):
            raise ValueError(f"data.weights must all be positive numbers, got {self.weights}")

    def _check_revision(self) -> None:
        if isinstance(self.revision, list) and (self.weights is None or len(self.revision) != len(self.source)):
            count = len(self.source) if self.weights is not None else 1
            raise ValueError(
                f"data.revision is a list of {len(self.revision)} but data.source has {count} source(s) to mix; give "
                "one revision per entry of a weighted data.source (null for a local one), or one revision as a string"
            )

    def revision_of(self, index: int | None = None) -> str | None:
        """The revision asked for the training source at ``index`` of a weighted list (None: the
        whole ``data.source``)."""
        if isinstance(self.revision, list):
            return self.revision[index or 0]
        return self.revision

    def _check_eval(self) -> None:
        if not (self.eval_fraction == 0 or 0 < self.eval_fraction < 1):
            raise ValueError(
                f"data.eval_fraction must be 0 (no hold-out) or between 0 and 1 exclusive, got {self.eval_fraction}; "
                "e.g. 0.1 holds out 10% of the examples"
            )
        if self.eval_fraction and (self.eval_source is not None or self.eval_split is not None):
            raise ValueError(
                "data.eval_fraction holds evaluation examples out of the training data, so it does not go with "
                "data.eval_source or data.eval_split; keep one way of choosing them"
            )
        if self.eval_source is None and self.eval_split == self.split:
            raise ValueError(
                f"data.eval_split={self.eval_split!r} is data.split: the evaluation examples would be the training "
                "examples; name another split (e.g. validation), set data.eval_source, or use data.eval_fraction"
            )

    @property
    def has_eval(self) -> bool:
        """Whether evaluation rows are made (from an eval source or split, or held out)."""
        return self.eval_source is not None or self.eval_split is not None or self.eval_fraction > 0

    @property
    def documents(self) -> bool:
        """Whether rows hold whole examples with their own positions (packing true or false)
        rather than a cut stream (format text with packing unset)."""
        return self.packing is not None or self.format != "text"
