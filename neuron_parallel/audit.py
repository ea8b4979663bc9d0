"""The audit of a tokenized dataset: what was made of the data, for people to check.

``tokenize_data`` returns it in ``TokenizedDataset.audit`` and writes it to ``audit.json``:
``format``, ``packing`` (stream, documents or padded), ``examples``, ``kept``, ``truncated``,
``dropped`` (for preference data, ``pairs`` too: every count is of pairs), ``tokens`` (real
tokens in rows), ``trained_tokens`` (labels that are not -100),
``trained_fraction``, ``rows``, ``fill`` (real tokens / (rows × block_size)), ``eval_examples``,
``eval_rows``, ``sample``: the first training example's text, the character spans that carry
no loss (``masked_spans``) and the text with each of them wrapped in «…» (``marked``), and
``lineage``: what each source was (``data.data_lineage``) and the rows' fingerprint.
"""

from __future__ import annotations

import numpy as np

from .config import DataConfig
from .lineage import describe_identity
from .packing import first_document


def build_audit(data: DataConfig, tokenizer, train_ex, train_rows, totals: dict, eval_ex, eval_rows) -> dict:
    """The audit of the training examples and rows (``totals``: ``packing.count_columns``) and of
    the evaluation ones (None when there are none)."""
    kept = totals["kept"] if data.documents else len(train_ex)  # the stream keeps every document
    return {
        "format": data.format,
        "packing": "stream" if not data.documents else "padded" if data.packing is False else "documents",
        "examples": len(train_ex),
        **({"pairs": len(train_ex)} if data.format == "preference" else {}),
        "kept": kept,
        "truncated": totals["truncated"],
        "dropped": len(train_ex) - kept,
        "tokens": totals["tokens"],
        "trained_tokens": totals["trained"],
        "trained_fraction": round(totals["trained"] / max(totals["tokens"], 1), 4),
        "rows": len(train_rows),
        "fill": round(totals["tokens"] / max(len(train_rows) * data.block_size, 1), 4),
        "eval_examples": len(eval_ex) if eval_ex is not None else 0,
        "eval_rows": len(eval_rows) if eval_rows is not None else 0,
        "sample": audit_sample(tokenizer, train_rows, stream=not data.documents),
    }


def audit_sample(tokenizer, rows, stream: bool) -> dict:
    """The first example of the first row as text, with the spans that carry no loss marked «…»."""
    if len(rows) == 0:
        return {"text": "", "masked_spans": [], "marked": ""}
    ids, targets = first_document(rows.with_format("numpy")[0])
    if stream:
        text = tokenizer.decode(ids.tolist(), clean_up_tokenization_spaces=False)[:500]
        return {"text": text, "masked_spans": [], "marked": text}
    text, marked, spans = "", "", []
    for run in np.split(np.arange(len(ids)), np.flatnonzero(np.diff(targets.astype(np.int8))) + 1):
        piece = tokenizer.decode(ids[run].tolist(), clean_up_tokenization_spaces=False)
        if not targets[run[0]]:
            spans.append([len(text), len(text) + len(piece)])
        marked += piece if targets[run[0]] else f"«{piece}»"
        text += piece
    return {"text": text, "masked_spans": spans, "marked": marked}


def audit_table(audit: dict) -> list[dict]:
    """The audit as rows of ``{"metric", "value"}`` (a table artifact), one per source of its
    lineage (``lineage.source``: ``org/name at commit …``); the sample is left out."""
    rows = [{"metric": k, "value": v} for k, v in audit.items() if k not in ("sample", "lineage")]
    return rows + [
        {"metric": f"lineage.{k}", "value": describe_identity(v)} for k, v in audit.get("lineage", {}).items()
    ]


def audit_markdown(audit: dict) -> str:
    """The sample of the audit as markdown: the first example, spans without loss in «…»."""
    sample = audit.get("sample", {})
    marked = sample.get("marked", "").replace("```", "`\u200b``")
    return (
        f"First training example ({audit.get('format')}, {audit.get('packing')}); text in «…» carries no loss.\n\n"
        f"```text\n{marked}\n```\n"
    )


def audit_summary(audit: dict) -> str:
    """One line of the audit's main numbers."""
    return (
        f"{audit['format']} ({audit['packing']}): {audit['kept']}/{audit['examples']} examples kept "
        f"({audit['truncated']} truncated, {audit['dropped']} dropped), {audit['rows']} rows at "
        f"{audit['fill']:.0%} fill, {audit['trained_tokens']}/{audit['tokens']} tokens trained "
        f"({audit['trained_fraction']:.0%}), eval {audit['eval_rows']} rows"
    )
