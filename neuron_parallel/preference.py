"""Preference tuning: pairs of completions of one prompt as rows, and the objectives that train on
them (DPO with its IPO, hinge and robust variants, SimPO, ORPO).

Data (``data.format: preference``). Each example has a prompt, a chosen and a rejected
completion (columns ``data.prompt_field``/``chosen_field``/``rejected_field``, default prompt,
chosen, rejected).

- String values are tokenized as TRL's ``DPOTrainer.tokenize_row`` did (TRL 0.x; TRL 1.x
  tokenizes prompt + completion as one text): the prompt's ids with BOS first where the tokenizer
  defines one, each completion's ids followed by EOS, each of the three tokenized alone without
  special tokens, so that a pair's prompt is the same ids in both documents. A completion's
  log-probability is the sum over its ids and the EOS.
- Chat message lists: the prompt is rendered with the chat template and the generation prompt; a
  completion (a list of assistant messages, or a string taken as one assistant message) is what
  rendering prompt + completion adds to that, all of it trained (the assistant turn with its end
  marker, as chat SFT trains it); prompt and completion are tokenized alone, without special
  tokens (the template writes its own).

A pair becomes two documents of one row, ``prompt + chosen`` then ``prompt + rejected``, each with
positions from 0 (the document mask keeps them apart); the prompt's tokens take no loss.
``sequence_ids`` tells, per labelled position, which completion it belongs to: ``2k`` for the
chosen and ``2k + 1`` for the rejected completion of the row's k-th pair, -1 where there is no
label. Pairs are packed greedily into rows (``data.packing: false``: one pair per row). A pair
longer than ``data.block_size`` loses tokens from the start of its prompt (the same in both
documents) until it fits, and is counted as truncated; if even a prompt of one token leaves no
room for both completions whole, the pair is dropped (counted).

Objectives (``train.objective``), per pair, from the policy's completion log-probabilities
(summed over the completion's tokens, or averaged where said) and, for DPO, the reference's; the
step's loss is the mean over the pairs of the global batch (:data:`PAIR_LOSS_RULE`). The formulas
are the papers' named in :func:`pair_losses` and TRL 1.16's (``DPOTrainer._compute_loss``,
``CPOTrainer.cpo_loss``, ``ORPOTrainer.odds_ratio_loss``), which tests/unit/test_preference_trl.py
runs on the same log-probabilities.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .config import DataConfig, PreferenceConfig
from .packing import index_dtype, segments
from .token_starts import encode_ids, id_lists, overlapped
from .utils import gc_paused

IGNORE = -100
STATS = ("loss", "rewards_chosen", "rewards_rejected", "rewards_accuracy", "logps_chosen", "logps_rejected")
"""The per-pair values summed over a batch's pairs, in this order (:func:`pair_stats`)."""
PAIR_LOSS_RULE = (
    "loss = sum of per-pair losses over the pairs of the whole global batch / their number, "
    "whatever the layout or accumulation"
)
REFERENCE_COLUMN = "reference_logps"
"""The reference dataset's column: per row, the reference's summed log-probability of each
completion, indexed by sequence id."""


def slots(block_size: int) -> int:
    """Sequence slots of a row (an even number > any sequence id of ``block_size`` tokens)."""
    return block_size + block_size % 2


# -- tokenization ----------------------------------------------------------------------------------


def pair_columns(data: DataConfig, columns: list[str], where: str) -> dict[str, str]:
    """The prompt, chosen and rejected columns; ValueError naming the missing one and its field."""
    out = {}
    for role, key, name in (
        ("prompt", "prompt_field", data.prompt_field or "prompt"),
        ("chosen", "chosen_field", data.chosen_field),
        ("rejected", "rejected_field", data.rejected_field),
    ):
        if name not in columns:
            raise ValueError(
                f"data.format=preference: {where} has no {role} column {name!r}; columns: {columns}; "
                f"set data.{key} to one of them"
            )
        out[role] = name
    return out


class PairEncoder:
    """The batched ``datasets.map`` function of one preference source: ``prompt``, ``chosen`` and
    ``rejected`` token ids per pair (see the module docstring), as Arrow list columns. Picklable
    for ``num_proc``."""

    def __init__(self, data: DataConfig, tokenizer, columns: dict[str, str], where: str) -> None:
        from .chat import ChatRenderer
        from .sft import chat_template

        self.data, self.tokenizer, self.columns, self.where = data, tokenizer, columns, where
        self.template = chat_template(data, tokenizer)
        name = data.chat_template or f"the chat template of the tokenizer {tokenizer.name_or_path}"
        self.chat = ChatRenderer(tokenizer, self.template, name) if self.template is not None else None

    def __call__(self, batch: dict[str, list], indices: list[int]):
        """``datasets.map``'s batched function: a batch of Python column lists."""
        from .sft import batch_piece

        with gc_paused():
            return self._pairs(partial(batch_piece, batch), indices)

    def encode_dataset(self, dataset):
        """Every row of ``dataset``, its three columns formatted as Python a piece at a time
        (``sft.dataset_piece``)."""
        from .sft import dataset_piece

        with gc_paused():
            columns = dataset.select_columns(list(set(self.columns.values())))
            piece = partial(dataset_piece, columns)
            types = dict(zip(columns.data.schema.names, columns.data.schema.types))
            c = self.columns
            if (
                self.chat is not None
                and _plain_chat(types[c["prompt"]], False)
                and all(_plain_chat(types[c[role]], True) for role in ("chosen", "rejected"))
            ):  # message lists of role and content only: pieces stay Arrow (_flat_texts)
                piece = partial(_arrow_piece, columns.with_format("arrow"))
            return self._pairs(piece, range(len(dataset)))

    def _pairs(self, piece, indices):
        """``piece(a, b)``: rows ``a`` to ``b`` as Python column lists; ``indices``: their row numbers."""
        import pyarrow as pa

        backend = self.tokenizer.backend_tokenizer
        tables = overlapped(
            len(indices),
            lambda a, b: self._texts(piece(a, b), [f"{self.where} row {indices[j]}" for j in range(a, b)]),
            # Every prompt, then every chosen, then every rejected text, in one call: one dispatch.
            lambda prepared: encode_ids(backend, [t[k] for k in range(3) for t in prepared[0]]),
            lambda prepared, every: pa.table(self._columns(*prepared, every)),
        )
        return pa.concat_tables(tables)

    def _texts(self, columns, wheres: list[str]) -> tuple[list, np.ndarray]:
        """The ``(prompt, chosen, rejected)`` texts of the rows in ``columns`` (Python column
        lists, or an Arrow table of plain message lists), and which of them are string pairs
        (TRL's ``tokenize_row``), the others rendered chats."""
        if not isinstance(columns, dict):
            texts = self._flat_texts(columns, wheres)
            if texts is not None:
                return texts, np.zeros(len(wheres), dtype=bool)
            columns = columns.to_pydict()
        c = self.columns
        texts: list = [None] * len(wheres)
        chats: list[tuple[int, list[dict], list[dict], list[dict], str]] = []
        for j, (where, prompt, chosen, rejected) in enumerate(
            zip(wheres, columns[c["prompt"]], columns[c["chosen"]], columns[c["rejected"]])
        ):
            for role, value in (("chosen", chosen), ("rejected", rejected)):
                if value in (None, "", []):
                    raise ValueError(
                        f"{where}: the {role} completion (column {c[role]!r}) is empty; every pair needs a "
                        f"non-empty chosen and rejected completion: fix or remove the row"
                    )
            if isinstance(prompt, list):
                chats.append((j, *self._chat_pair(prompt, chosen, rejected, where), where))
            elif isinstance(prompt, str | None) and isinstance(chosen, str) and isinstance(rejected, str):
                texts[j] = (prompt or "", chosen, rejected)
            else:
                raise ValueError(
                    f"{where}: a pair's prompt, chosen and rejected values must be strings, or chat message lists "
                    f"(the prompt a list of messages); got {type(prompt).__name__}, {type(chosen).__name__}, "
                    f"{type(rejected).__name__}: fix the data"
                )
        plain = np.asarray([t is not None for t in texts], dtype=bool)
        if chats:
            split = self.chat.split_pairs([c[1:4] for c in chats], [c[4] for c in chats])
            for (j, *_), rendered in zip(chats, split):
                texts[j] = rendered
        return texts, plain

    def _flat_texts(self, table, wheres: list[str]) -> list | None:
        """The texts of an Arrow piece of chat pairs whose messages are role and content only,
        read as flat columns (``ChatRenderer.split_flat_pairs``): no dictionary per message, no
        check per message (Arrow's are per column). None where a value is missing or empty or a
        role unknown: the Python path names the row. Pairs not written from layouts go that way
        too."""
        c = self.columns
        flats = [_flat_messages(table.column(c[role])) for role in ("prompt", "chosen", "rejected")]
        if any(flat is None for flat in flats):
            return None
        texts = self.chat.split_flat_pairs(*flats, wheres)
        rest = [j for j, text in enumerate(texts) if text is None]
        if rest:
            done, _ = self._texts(table.take(rest).to_pydict(), [wheres[j] for j in rest])
            for j, text in zip(rest, done):
                texts[j] = text
        return texts

    def _columns(self, texts: list, plain: np.ndarray, every: list) -> dict:
        """The ``prompt``, ``chosen`` and ``rejected`` id lists of ``texts`` from their encodings
        ``every`` (every prompt, then every chosen, then every rejected completion)."""
        tok, n = self.tokenizer, len(texts)
        bos = tok.bos_token_id
        columns = {}
        for k, name in enumerate(("prompt", "chosen", "rejected")):
            encodings = every[k * n : (k + 1) * n]
            if k == 0:  # BOS + prompt
                columns[name] = id_lists(encodings, bos, plain if bos is not None else None, end=False)
            else:  # completion + EOS
                columns[name] = id_lists(encodings, tok.eos_token_id, plain, end=True)
        return columns

    def _chat_pair(self, prompt: list, chosen: Any, rejected: Any, where: str) -> tuple[list, list, list]:
        """The prompt and each completion as checked message lists (a string completion is one
        assistant message)."""
        from .sft import check_messages

        if self.template is None:
            raise ValueError(
                f"{where}: chat message pairs need a chat template, but the tokenizer has none; set "
                "data.chat_template: path/to/template.jinja (e.g. neuron_parallel/chat_templates/chatml.jinja)"
            )
        out = [check_messages(prompt, where)]
        for role, value in (("chosen", chosen), ("rejected", rejected)):
            turns = [{"role": "assistant", "content": value}] if isinstance(value, str) else value
            out.append(check_messages(turns, f"{where} ({role})"))
        return out[0], out[1], out[2]


def _arrow_piece(dataset, a: int, b: int):
    """Rows ``a`` to ``b`` of a ``datasets.Dataset`` in Arrow format, as a ``pyarrow.Table``."""
    return dataset[a:b]


def _plain_chat(kind, completion: bool) -> bool:
    """Whether Arrow type ``kind`` is a list of messages of a string role and content and nothing
    else (or, for a ``completion``, a string)."""
    import pyarrow as pa

    if completion and pa.types.is_string(kind):
        return True
    if not pa.types.is_list(kind) or not pa.types.is_struct(kind.value_type):
        return False
    fields = {f.name: f.type for f in kind.value_type}
    return set(fields) == {"role", "content"} and all(pa.types.is_string(t) for t in fields.values())


def _flat_messages(column):
    """A column of :func:`_plain_chat` values as ``chat.Flat`` (a string: one assistant message),
    or None where a value or message is missing, a value is empty, or a role is not one of
    ``sft.ROLES``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from .sft import ROLES

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(column)
    if column.null_count:
        return None
    if pa.types.is_string(column.type):
        if n and pc.min(pc.utf8_length(column)).as_py() == 0:
            return None
        return ["assistant"] * n, column.to_pylist(), list(range(n + 1))
    if n and pc.min(pc.list_value_length(column)).as_py() == 0:
        return None
    messages = column.flatten()
    kind = messages.type
    role, content = (messages.flatten()[kind.get_field_index(name)] for name in ("role", "content"))
    if messages.null_count or role.null_count or content.null_count:
        return None
    if not pc.all(pc.is_in(role, value_set=pa.array(ROLES))).as_py():
        return None
    offsets = column.offsets.to_numpy()
    return role.to_pylist(), content.to_pylist(), (offsets - offsets[0]).tolist()


def pair_features():
    from datasets import Features, List, Value

    return Features({name: List(Value("int32")) for name in ("prompt", "chosen", "rejected")})


# -- rows --------------------------------------------------------------------------------------------


def fit_pair(p: int, c: int, r: int, block_size: int) -> int | None:
    """Prompt tokens to drop from the start so that a pair of prompt ``p``, completions ``c`` and
    ``r`` tokens fits one row (0: it fits), or None when even one prompt token leaves no room."""
    need = 2 * p + c + r
    if need <= block_size:
        return 0
    cut = -(-(need - block_size) // 2)
    return cut if p - cut >= 1 else None


def pair_rows(table, *, block_size: int, pad_id: int, one_per_row: bool):
    """Rows of pairs (see the module docstring) from an Arrow batch of ``prompt``, ``chosen`` and
    ``rejected`` lists, with the count columns of ``neuron_parallel.packing``. Built as
    ``packing.document_rows`` builds its rows: each kept pair is four segments, prompt, chosen,
    prompt, rejected, and every position of the rows reads its token through one source index
    (``packing.segments``); only the greedy placement runs per pair. A completion token is the
    label of the position before it in its document; the first position of a document has none
    before it (an empty prompt: the first completion token is not predicted)."""
    from .packing import _flat, _greedy, _table, fill_rows, in_order, padding_starts

    values, starts, lengths = [], [], []
    for name in ("prompt", "chosen", "rejected"):
        flat, offsets = _flat(table, name)
        starts.append(offsets[:-1] + sum(len(v) for v in values))  # into the three concatenated
        lengths.append(np.diff(offsets))
        values.append(flat)
    n = sum(len(v) for v in values)
    tokens = np.concatenate([*values, [pad_id]]).astype(np.int32, copy=False)  # index n: the padding's token
    p, c, r = lengths
    need = 2 * p + c + r  # fit_pair for every pair at once
    cut = np.where(need > block_size, -(-(need - block_size) // 2), 0)
    kept = np.flatnonzero((need <= block_size) | (p - cut >= 1))
    cut, p, c, r = cut[kept], p[kept] - cut[kept], c[kept], r[kept]
    size = 2 * p + c + r
    row, col = _greedy(size, block_size, one_per_row)
    num_rows = int(row[-1]) + 1 if len(row) else 0
    first = np.r_[True, row[1:] != row[:-1]] if len(row) else np.zeros(0, dtype=bool)
    slot = np.arange(len(row)) - np.flatnonzero(first)[np.cumsum(first) - 1]  # the pair's place in its row
    used = np.bincount(row, weights=size, minlength=num_rows).astype(np.int32)

    # Per pair, segments prompt, chosen, prompt, rejected: place, source start, first position
    # and sequence id (-1 for a prompt); then each row's padding, reading the token at index n.
    at = row * block_size + col
    zero, none = np.zeros_like(p), np.full_like(p, -1)
    prompt_src = starts[0][kept] + cut
    columns = (
        (at, at + p, at + p + c, at + 2 * p + c),
        (prompt_src, starts[1][kept], prompt_src, starts[2][kept]),
        (zero, p, zero, p),
        (none, 2 * slot, none, 2 * slot + 1),
    )
    seg_at, seg_src, seg_pos, seg_id = (np.stack(cols, axis=1).reshape(-1) for cols in columns)
    nonempty = np.stack([p, c, p, r], axis=1).reshape(-1) > 0  # an empty prompt has no segment
    pad_at = padding_starts(used, block_size)
    pads = len(pad_at)
    seg_at, seg_src, seg_pos, seg_id = in_order(
        np.r_[seg_at[nonempty], pad_at],
        np.r_[seg_src[nonempty], np.full(pads, n)],
        np.r_[seg_pos[nonempty], np.zeros(pads, dtype=seg_pos.dtype)],
        np.r_[seg_id[nonempty], np.full(pads, -1, dtype=seg_id.dtype)],
    )
    counts = {
        "_kept": np.bincount(row, minlength=num_rows),
        "_truncated": np.bincount(row, weights=cut > 0, minlength=num_rows),
        "_tokens": used,
        "_trained": np.bincount(row, weights=c + r - 2 * (p == 0), minlength=num_rows),
    }
    fill = partial(_fill_pairs, tokens, block_size, seg_at, seg_src, seg_pos, seg_id)
    return _table(block_size, counts, **fill_rows(fill, ROW_COLUMNS, num_rows, block_size))


ROW_COLUMNS = ("input_ids", "labels", "position_ids", "sequence_ids")


def _fill_pairs(tokens, block_size: int, seg_at, seg_src, seg_pos, seg_id, out: dict, first: int, end: int) -> None:
    """Rows ``first`` to ``end`` of :func:`pair_rows` into ``out`` (flat rows by column), from the
    segments of every row (``seg_at`` increasing, a row's first position always among them);
    ``tokens[-1]`` is the padding's token."""
    a, b = first * block_size, end * block_size
    lo, hi = np.searchsorted(seg_at, [a, b])
    at, total, n = seg_at[lo:hi] - a, b - a, len(tokens) - 1
    src = segments(at, seg_src[lo:hi], total, step=1, dtype=index_dtype(n + block_size, total))
    np.minimum(src, n, out=src)
    input_ids, labels, positions, sequence_ids = (out[name][a:b] for name in ROW_COLUMNS)
    tokens.take(src, out=input_ids)
    segments(at, seg_pos[lo:hi], total, step=1, dtype=np.int32, out=positions)  # padding counts from 0
    segment_ids = segments(at, seg_id[lo:hi], total, step=0, dtype=np.int32)
    # Position t is labelled when t + 1 holds a completion token with a position before it; the
    # last position of a row never is (the next row starts at position 0).
    target = segment_ids[1:] >= 0
    target &= positions[1:] > 0
    labels.fill(IGNORE)
    sequence_ids.fill(-1)
    np.copyto(labels[:-1], input_ids[1:], where=target)
    np.copyto(sequence_ids[:-1], segment_ids[1:], where=target)


def pairs_per_row(sequence_ids: np.ndarray) -> np.ndarray:
    """Pairs in each row of ``sequence_ids`` (rows, block_size), on the host."""
    return (np.asarray(sequence_ids).max(axis=1) + 1) // 2


# -- log-probabilities and objectives ----------------------------------------------------------------


def sequence_logps(
    token_logps: torch.Tensor, sequence_ids: torch.Tensor, num_slots: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and pair slot, the summed log-probabilities and the token counts of the chosen
    ``[..., 0]`` and rejected ``[..., 1]`` completions, ``(rows, slots / 2, 2)``: a segment sum
    of ``token_logps`` (rows, seq; 0 where there is no label) by ``sequence_ids``, on the device.
    ``num_slots``: the :func:`slots` of the whole rows where these are part of them (context
    parallelism); by default those of ``seq``."""
    rows, seq = sequence_ids.shape
    n = num_slots or slots(seq)
    index = torch.where(sequence_ids < 0, n, sequence_ids)  # unlabelled positions go to a spare slot
    sums = torch.zeros(rows, n + 1, dtype=torch.float32, device=token_logps.device)
    sums = sums.scatter_add(1, index, token_logps.float())
    counts = torch.zeros(rows, n + 1, dtype=torch.float32, device=token_logps.device)
    counts = counts.scatter_add(1, index, torch.ones_like(token_logps, dtype=torch.float32))
    return sums[:, :n].view(rows, n // 2, 2), counts[:, :n].view(rows, n // 2, 2)


def completion_logps(stage, hidden: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor):
    """:func:`sequence_logps` of ``stage.token_logps(hidden, labels)`` (``stage``: the last
    ``CausalLMStage``). Under context parallelism (``stage.context``) the rows hold one cp rank's
    positions: the sums and counts of every completion are summed over the cp ranks
    (``ContextShard.sum``, one all-reduce) before any pair's loss, as completions cross shards."""
    logps = stage.token_logps(hidden, labels)
    context = getattr(stage, "context", None)
    if context is None:
        return sequence_logps(logps, sequence_ids)
    sums, counts = sequence_logps(logps, sequence_ids, num_slots=slots(labels.shape[-1] * context.cp))
    both = context.sum(torch.stack([sums, counts]))
    return both[0], both[1]


def pair_losses(
    objective: str,
    cfg: PreferenceConfig,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(losses, chosen rewards, rejected rewards)`` per pair, from the log-probabilities the
    objective takes (:func:`objective_logps`).

    - dpo (Rafailov et al. 2023, arXiv:2305.18290), with ``logits = (π_c − ref_c) − (π_r − ref_r)``:
      sigmoid ``−logσ(βx)(1−ε) − logσ(−βx)ε`` (ε = label_smoothing: cDPO); robust (Chowdhury et
      al. 2024, arXiv:2403.00409) ``(−logσ(βx)(1−ε) + logσ(−βx)ε) / (1 − 2ε)``; hinge (SLiC, Zhao et
      al. 2023) ``relu(1 − βx)``; ipo (Azar et al. 2023, arXiv:2310.12036) ``(x − 1/(2β))²`` on
      length-averaged log-probabilities. Rewards ``β(π − ref)`` (under ipo on the averaged
      log-probabilities too, where TRL logs them from the sums). The losses are TRL's
      (``DPOTrainer._compute_loss``), except that TRL 1.16 applies no label smoothing to sigmoid:
      cDPO's smoothed sigmoid is TRL's ``CPOTrainer.cpo_loss`` sigmoid of the log-ratios.
    - simpo (Meng et al. 2024, arXiv:2405.14734): ``x = π̄_c − π̄_r − γ/β`` on averaged
      log-probabilities, loss as dpo's sigmoid; rewards ``β π̄``. As TRL's ``CPOTrainer.cpo_loss``
      with loss_type simpo and cpo_alpha 0.
    - orpo (Hong et al. 2024, arXiv:2403.07691): on averaged log-probabilities,
      ``log_odds = (π̄_c − π̄_r) − (log(1 − e^π̄_c) − log(1 − e^π̄_r))``, loss
      ``−π̄_c − β logσ(log_odds)`` (the chosen completion's mean NLL plus the odds-ratio term with
      weight λ = β); rewards ``β π̄``. As TRL's ``ORPOTrainer.odds_ratio_loss``, except that the NLL
      is each pair's own mean over its chosen completion, so that the loss is a mean over pairs
      (TRL's is the mean over every chosen token of the batch, prompt tokens included: the same
      when the chosen completions are equally long and the prompt is one token).
    """
    beta, eps = cfg.beta, cfg.label_smoothing
    if objective == "dpo":
        chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
        x = (chosen - ref_chosen) - (rejected - ref_rejected)
        if cfg.loss_type == "sigmoid":
            losses = -F.logsigmoid(beta * x) * (1 - eps) - F.logsigmoid(-beta * x) * eps
        elif cfg.loss_type == "robust":
            losses = (-F.logsigmoid(beta * x) * (1 - eps) + F.logsigmoid(-beta * x) * eps) / (1 - 2 * eps)
        elif cfg.loss_type == "hinge":
            losses = torch.relu(1 - beta * x)
        else:  # ipo
            losses = (x - 1 / (2 * beta)) ** 2
        return losses, chosen_rewards, rejected_rewards
    if objective == "simpo":
        x = chosen - rejected - cfg.gamma / beta
        losses = -F.logsigmoid(beta * x) * (1 - eps) - F.logsigmoid(-beta * x) * eps
        return losses, beta * chosen, beta * rejected
    if objective == "orpo":
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        losses = -chosen - beta * F.logsigmoid(log_odds)
        return losses, beta * chosen, beta * rejected
    raise ValueError(f"train.objective={objective!r} is not a preference objective")


def averages(objective: str, cfg: PreferenceConfig) -> bool:
    """Whether ``objective`` takes length-averaged log-probabilities (SimPO, ORPO, DPO's ipo)."""
    return objective in ("simpo", "orpo") or (objective == "dpo" and cfg.loss_type == "ipo")


def pair_stats(
    objective: str,
    cfg: PreferenceConfig,
    sums: torch.Tensor,
    counts: torch.Tensor,
    reference: torch.Tensor | None = None,
) -> torch.Tensor:
    """The :data:`STATS` summed over the pairs present: ``sums``/``counts`` from
    :func:`sequence_logps` (rows, pairs, 2), ``reference`` the reference's summed log-probabilities
    in the same shape (dpo). A slot without tokens is no pair and adds nothing."""
    present = counts[..., 0] > 0
    denom = counts.clamp(min=1) if averages(objective, cfg) else torch.ones_like(counts)
    # Empty slots take a finite stand-in (-1), so that no formula meets log(0) there, not even in
    # a gradient that the mask then zeroes.
    keep = present.unsqueeze(-1)
    logps = torch.where(keep, sums / denom, -1.0)
    refs = ()
    if reference is not None:
        ref = torch.where(keep, reference / denom, -1.0)
        refs = (ref[..., 0], ref[..., 1])
    losses, rc, rr = pair_losses(objective, cfg, logps[..., 0], logps[..., 1], *refs)
    values = (losses, rc, rr, (rc > rr).float(), logps[..., 0], logps[..., 1])
    return torch.stack([torch.where(present, v, torch.zeros_like(v)).sum() for v in values])


def stats_row(values: list[float], pairs: int, prefix: str = "") -> dict[str, float]:
    """Means over ``pairs`` of summed :data:`STATS` as a metrics row (``rewards_margin`` added)."""
    mean = {name: v / max(pairs, 1) for name, v in zip(STATS, values)}
    mean["rewards_margin"] = mean["rewards_chosen"] - mean["rewards_rejected"]
    return {f"{prefix}{k}": v for k, v in mean.items()}


# -- the reference's log-probabilities (full fine-tuning) --------------------------------------------


REFERENCE_RECORD = "reference.json"
"""The record of a reference folder (:func:`compute_reference`): the reference weights' digest
(``model_sha256``, ``checkpoint.format.base_model_identity``) and the rows' identities
(:func:`rows_identity`) of its ``train`` and ``eval`` parts."""


def reference_dir(dataset_path: str | Path, model_digest: str) -> Path:
    """Where the reference log-probabilities of the tokenized dataset at ``dataset_path`` (its
    ``train`` folder) under reference weights of digest ``model_digest`` are kept: beside it."""
    return Path(dataset_path).parent / f"reference-{model_digest[:20]}"


def needs_reference(objective: str, lora: object | None) -> bool:
    """Whether the reference step computes reference log-probabilities: DPO fine-tuning every
    weight (under LoRA the base with its adapters off is the reference, in the same step)."""
    return objective == "dpo" and lora is None


def compute_reference(
    model_path: str | Path,
    dataset_path: str | Path,
    eval_path: str | Path | None,
    *,
    device: str = "cpu",
    rows_per_batch: int = 8,
) -> Path:
    """The reference log-probabilities of every row of the tokenized preference rows at
    ``dataset_path`` (and ``eval_path``) under the weights in ``model_path``: per row, each
    completion's summed log-probability by sequence id (``REFERENCE_COLUMN``, ``slots`` floats),
    in one process, fp32, with the stage code training runs (document mask, chunked lm_head). Kept
    in :func:`reference_dir` (the weights' digest in its name) and reused when its record says it
    holds these rows' values under these weights: a retry or a recurring run computes nothing
    again (a folder left from rows since rewritten is computed anew). Returns the folder
    (``train`` and, with eval rows, ``eval``)."""
    import json
    import os
    import shutil

    from .checkpoint.format import base_model_identity

    digest = base_model_identity(model_path)["sha256"]
    out = reference_dir(dataset_path, digest)
    rows = splits_identity(dataset_path, eval_path)
    if not reference_problem(out, model_sha256=digest, rows=rows):
        return out
    stage = _reference_stage(model_path, torch.device(device))
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, path in (("train", dataset_path), ("eval", eval_path)):
        if path is not None:
            _reference_rows(stage, path, rows_per_batch).save_to_disk(str(tmp / name))
    (tmp / REFERENCE_RECORD).write_text(json.dumps({"model_sha256": digest, "rows": rows}))
    if out.exists() and reference_problem(out, model_sha256=digest, rows=rows):
        shutil.rmtree(out)  # computed for rows since rewritten in place (or by an older version): stale
    try:
        tmp.rename(out)
    except OSError:
        if reference_problem(out, model_sha256=digest, rows=rows):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def rows_identity(path: str | Path) -> dict:
    """What the reference values of the tokenized rows at ``path`` are aligned with: the name of
    the folder holding them (the tokenize step names it by the rows' fingerprint,
    ``<cache_dir>/<fingerprint>/train``), which split they are, and how many rows there are."""
    from datasets import load_from_disk

    path = Path(path)
    return {"fingerprint": path.resolve().parent.name, "split": path.name, "num_rows": len(load_from_disk(str(path)))}


def splits_identity(dataset_path: str | Path, eval_path: str | Path | None) -> dict:
    """The :func:`rows_identity` of the training rows (``train``) and of the eval rows (``eval``,
    None without them), as a reference folder's record holds them."""
    return {"train": rows_identity(dataset_path), "eval": rows_identity(eval_path) if eval_path else None}


def reference_problem(reference: str | Path, *, model_sha256: str, rows: dict) -> str | None:
    """Why the reference folder ``reference`` does not hold the reference log-probabilities of
    ``rows`` (:func:`splits_identity`) under the weights of digest
    ``model_sha256``, in words; None when it does (its :data:`REFERENCE_RECORD` says so)."""
    import json

    record_path = Path(reference) / REFERENCE_RECORD
    if not record_path.is_file():
        return f"{reference} holds no {REFERENCE_RECORD}: it is not a folder the reference step wrote"
    record = json.loads(record_path.read_text())
    if record.get("model_sha256") != model_sha256:
        theirs, ours = str(record.get("model_sha256"))[:12], model_sha256[:12]
        return f"its values are those of other weights (sha256 {theirs}…) than the model's (sha256 {ours}…)"
    saved = record.get("rows") if isinstance(record.get("rows"), dict) else {}
    for split, ident in rows.items():
        if ident is not None and saved.get(split) != ident:
            return f"its {split} values are those of other rows ({saved.get(split)}) than the job's ({ident})"
    return None


def check_reference(
    reference_path: str | Path, model_path: str | Path, dataset_path: str, eval_path: str | None
) -> None:
    """Refuse, with a ``ValueError`` naming the job's keys and the fix, a reference folder that
    does not hold the reference log-probabilities of the rows at ``dataset_path`` (and
    ``eval_path``) under the weights in ``model_path`` (:func:`reference_problem`). Hashes the
    weights, as the reference step does."""
    from .checkpoint.format import base_model_identity

    digest = base_model_identity(model_path)["sha256"]
    why = reference_problem(reference_path, model_sha256=digest, rows=splits_identity(dataset_path, eval_path))
    if why:
        raise ValueError(
            f"job reference_path={reference_path} does not match the job's model_path={model_path} "
            f"(model.name_or_path) and rows (dataset_path={dataset_path}, eval_dataset_path={eval_path}): {why}; "
            "rerun the reference step (neuron_parallel.preference.compute_reference) for this model and these rows"
        )


def _reference_stage(model_path: str | Path, device: torch.device):
    from .checkpoint.tensors import HFWeights
    from .models.causal_lm import CausalLMStage, build_meta_model, load_config, load_weights, materialize

    config = load_config(model_path)
    full = build_meta_model(config)
    stage = CausalLMStage(full, range(config.num_hidden_layers), first=True, last=True)
    materialize(stage, device)
    load_weights(stage, HFWeights(str(model_path)), tied=bool(config.tie_word_embeddings))
    stage.return_logits = False
    return stage.eval()


@torch.no_grad()
def _reference_rows(stage, path: str | Path, rows_per_batch: int):
    from datasets import Dataset, Features, List, Value, load_from_disk

    rows = load_from_disk(str(path)).with_format("numpy")
    device = next(stage.parameters()).device
    width = slots(len(rows[0]["input_ids"])) if len(rows) else 0
    values = []
    for start in range(0, len(rows), rows_per_batch):
        part = rows[start : start + rows_per_batch]
        ids, labels, positions, seq = (
            torch.as_tensor(np.asarray(part[c], dtype=np.int64), device=device)
            for c in ("input_ids", "labels", "position_ids", "sequence_ids")
        )
        sums, _ = sequence_logps(stage.token_logps(stage(ids, positions), labels), seq)
        values.extend(sums.reshape(len(ids), width).cpu().numpy())
    features = Features({REFERENCE_COLUMN: List(Value("float32"), length=width)})
    return Dataset.from_dict({REFERENCE_COLUMN: [v.tolist() for v in values]}, features=features)
