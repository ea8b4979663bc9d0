"""Preference tuning: pairs of completions of one prompt as rows, and the objectives that train on
them (DPO with its IPO, hinge and robust variants, SimPO, ORPO).

Data (``data.format: preference``): pairs tokenized and packed into rows by
``neuron_parallel.pairs``.

Objectives (``train.objective``), per pair, from the policy's completion log-probabilities
(summed over the completion's tokens, or averaged where said) and, for DPO, the reference's; the
step's loss is the mean over the pairs of the global batch (:data:`PAIR_LOSS_RULE`). The formulas
are the papers' named in :func:`pair_losses` and TRL 1.16's (``DPOTrainer._compute_loss``,
``CPOTrainer.cpo_loss``, ``ORPOTrainer.odds_ratio_loss``), which tests/unit/test_preference_trl.py
runs on the same log-probabilities.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .config import PreferenceConfig

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
