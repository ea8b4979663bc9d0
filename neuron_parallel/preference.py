"""Preference tuning: pairs of completions of one prompt as rows, and the objectives that train on
them (DPO with its IPO, hinge and robust variants, SimPO, ORPO).

Data (``data.format: preference``). Each example has a prompt, a chosen and a rejected
completion (columns ``data.prompt_field``/``chosen_field``/``rejected_field``, default prompt,
chosen, rejected).

- String values are tokenized as TRL's ``DPOTrainer.tokenize_row`` does: the prompt's ids with
  BOS first where the tokenizer defines one, each completion's ids followed by EOS, each of the
  three tokenized alone without special tokens. A completion's log-probability is the sum over its
  ids and the EOS.
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
follow TRL (``DPOTrainer.dpo_loss``, ``CPOTrainer.cpo_loss``, ``ORPOTrainer.odds_ratio_loss``)
and the papers named in :func:`pair_losses`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .config import DataConfig, PreferenceConfig

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
    ``rejected`` token ids per pair (see the module docstring). Picklable for ``num_proc``."""

    def __init__(self, data: DataConfig, tokenizer, columns: dict[str, str], where: str) -> None:
        from .sft import chat_template

        self.data, self.tokenizer, self.columns, self.where = data, tokenizer, columns, where
        self.template = chat_template(data, tokenizer)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [e.ids for e in self.tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        c, tok = self.columns, self.tokenizer
        out: dict[str, list] = {"prompt": [], "chosen": [], "rejected": []}
        texts: list[tuple[str, str, str, bool]] = []
        for j, i in enumerate(indices):
            where = f"{self.where} row {i}"
            prompt = batch[c["prompt"]][j]
            chosen, rejected = batch[c["chosen"]][j], batch[c["rejected"]][j]
            for role, value in (("chosen", chosen), ("rejected", rejected)):
                if value in (None, "", []):
                    raise ValueError(
                        f"{where}: the {role} completion (column {c[role]!r}) is empty; every pair needs a "
                        f"non-empty chosen and rejected completion: fix or remove the row"
                    )
            if isinstance(prompt, list):
                texts.append((*self._render_chat(prompt, chosen, rejected, where), False))
            elif isinstance(prompt, str | None) and isinstance(chosen, str) and isinstance(rejected, str):
                texts.append((prompt or "", chosen, rejected, True))
            else:
                raise ValueError(
                    f"{where}: a pair's prompt, chosen and rejected values must be strings, or chat message lists "
                    f"(the prompt a list of messages); got {type(prompt).__name__}, {type(chosen).__name__}, "
                    f"{type(rejected).__name__}: fix the data"
                )
        prompts = self._encode([t[0] for t in texts])
        chosen = self._encode([t[1] for t in texts])
        rejected = self._encode([t[2] for t in texts])
        bos, eos = tok.bos_token_id, tok.eos_token_id
        for p, ch, rj, plain in zip(prompts, chosen, rejected, (t[3] for t in texts)):
            if plain:  # TRL's tokenize_row: BOS + prompt, completion + EOS
                p = ([bos] if bos is not None else []) + p
                ch, rj = ch + [eos], rj + [eos]
            out["prompt"].append(p)
            out["chosen"].append(ch)
            out["rejected"].append(rj)
        return out

    def _render_chat(self, prompt: list, chosen: Any, rejected: Any, where: str) -> tuple[str, str, str]:
        from .sft import check_messages

        if self.template is None:
            raise ValueError(
                f"{where}: chat message pairs need a chat template, but the tokenizer has none; set "
                "data.chat_template: path/to/template.jinja (e.g. neuron_parallel/chat_templates/chatml.jinja)"
            )
        prompt = check_messages(prompt, where)
        kw = dict(tokenize=False, chat_template=self.template)
        head = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **kw)
        out = [head]
        for role, value in (("chosen", chosen), ("rejected", rejected)):
            turns = [{"role": "assistant", "content": value}] if isinstance(value, str) else value
            turns = check_messages(turns, f"{where} ({role})")
            full = self.tokenizer.apply_chat_template(prompt + turns, add_generation_prompt=False, **kw)
            if not full.startswith(head) or len(full) == len(head):
                raise ValueError(
                    f"{where}: the chat template does not render the {role} completion as an addition to the prompt "
                    "rendered with the generation prompt; use a template that does (neuron_parallel/chat_templates/)"
                )
            out.append(full[len(head) :])
        return out[0], out[1], out[2]


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
    ``rejected`` lists, with the count columns of ``neuron_parallel.packing``."""
    import pyarrow as pa

    cols = {n: table.column(n).to_pylist() for n in ("prompt", "chosen", "rejected")}
    units, truncated = [], []
    for p, ch, rj in zip(cols["prompt"], cols["chosen"], cols["rejected"]):
        cut = fit_pair(len(p), len(ch), len(rj), block_size)
        if cut is None:
            continue
        units.append((p[cut:], ch, rj))
        truncated.append(cut > 0)
    rows: list[list[int]] = []  # pair indices per row
    used = block_size + 1
    for i, (p, ch, rj) in enumerate(units):
        n = 2 * len(p) + len(ch) + len(rj)
        if one_per_row or used + n > block_size:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    num = len(rows)
    ids = np.full((num, block_size), pad_id, dtype=np.int64)
    labels = np.full((num, block_size), IGNORE, dtype=np.int64)
    seq = np.full((num, block_size), -1, dtype=np.int64)
    positions = np.zeros((num, block_size), dtype=np.int64)
    counts = {k: np.zeros(num, dtype=np.int64) for k in ("_kept", "_truncated", "_tokens", "_trained")}
    for r, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members):
            p, *completions = units[i]
            for s, comp in enumerate(completions):
                doc = np.asarray(p + comp, dtype=np.int64)
                n = len(doc)
                ids[r, at : at + n] = doc
                positions[r, at : at + n] = np.arange(n)
                labels[r, at + len(p) - 1 : at + n - 1] = doc[len(p) :]
                seq[r, at + len(p) - 1 : at + n - 1] = 2 * k + s
                at += n
                counts["_trained"][r] += len(comp)
            counts["_kept"][r] += 1
            counts["_truncated"][r] += truncated[i]
        positions[r, at:] = np.arange(block_size - at)
        counts["_tokens"][r] = at

    def fixed(a: np.ndarray):
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1).astype(np.int32)), block_size)

    arrays = {"input_ids": ids, "labels": labels, "position_ids": positions, "sequence_ids": seq}
    return pa.table({**{k: fixed(v) for k, v in arrays.items()}, **{k: pa.array(v) for k, v in counts.items()}})


def pairs_per_row(sequence_ids: np.ndarray) -> np.ndarray:
    """Pairs in each row of ``sequence_ids`` (rows, block_size), on the host."""
    return (np.asarray(sequence_ids).max(axis=1) + 1) // 2


# -- log-probabilities and objectives ----------------------------------------------------------------


def sequence_logps(token_logps: torch.Tensor, sequence_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and pair slot, the summed log-probabilities and the token counts of the chosen
    ``[..., 0]`` and rejected ``[..., 1]`` completions, ``(rows, slots / 2, 2)``: a segment sum
    of ``token_logps`` (rows, seq; 0 where there is no label) by ``sequence_ids``, on the device."""
    rows, seq = sequence_ids.shape
    n = slots(seq)
    index = torch.where(sequence_ids < 0, n, sequence_ids)  # unlabelled positions go to a spare slot
    sums = torch.zeros(rows, n + 1, dtype=torch.float32, device=token_logps.device)
    sums = sums.scatter_add(1, index, token_logps.float())
    counts = torch.zeros(rows, n + 1, dtype=torch.float32, device=token_logps.device)
    counts = counts.scatter_add(1, index, torch.ones_like(token_logps, dtype=torch.float32))
    return sums[:, :n].view(rows, n // 2, 2), counts[:, :n].view(rows, n // 2, 2)


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
      length-averaged log-probabilities. Rewards ``β(π − ref)``. As TRL's ``DPOTrainer.dpo_loss``.
    - simpo (Meng et al. 2024, arXiv:2405.14734): ``x = π̄_c − π̄_r − γ/β`` on averaged
      log-probabilities, loss as dpo's sigmoid; rewards ``β π̄``. As TRL's ``CPOTrainer.cpo_loss``
      with loss_type simpo and cpo_alpha 0.
    - orpo (Hong et al. 2024, arXiv:2403.07691): on averaged log-probabilities,
      ``log_odds = (π̄_c − π̄_r) − (log(1 − e^π̄_c) − log(1 − e^π̄_r))``, loss
      ``−π̄_c − β logσ(log_odds)`` (the chosen completion's mean NLL plus the odds-ratio term with
      weight λ = β); rewards ``β π̄``. As TRL's ``ORPOTrainer.odds_ratio_loss``, except that the NLL
      is each pair's own token mean (TRL averages over the batch's chosen tokens: the same when the
      chosen completions are equally long), so that the loss is a mean over pairs.
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
    in :func:`reference_dir` (the weights' digest in its name) and reused when there: a retry or a
    recurring run computes nothing again. Returns the folder (``train`` and, with eval rows,
    ``eval``)."""
    import json
    import os
    import shutil

    from .checkpoint.format import base_model_identity

    digest = base_model_identity(model_path)["sha256"]
    out = reference_dir(dataset_path, digest)
    if (out / "reference.json").exists():
        return out
    stage = _reference_stage(model_path, torch.device(device))
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, path in (("train", dataset_path), ("eval", eval_path)):
        if path is not None:
            _reference_rows(stage, path, rows_per_batch).save_to_disk(str(tmp / name))
    (tmp / "reference.json").write_text(json.dumps({"model_sha256": digest, "rows": str(dataset_path)}))
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "reference.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


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
