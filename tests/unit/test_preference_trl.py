"""Each preference objective's loss and rewards against TRL's own loss code (trl 1.16, the `test`
extra's pin) on the same log-probabilities. Random logits over a small vocabulary give every
completion token's log-probability; TRL reads them through its trainers' loss methods, called on
bare instances (``object.__new__``) that hold only the attributes those methods read and a stub
model that returns the logits (or, for DPO, the per-token log-probabilities its fused head would),
while ours reads them packed two pairs to a row, through ``sequence_logps`` and ``pair_stats``.

- dpo sigmoid, hinge, ipo and robust (with label smoothing): ``DPOTrainer._compute_loss`` with
  precomputed reference log-probabilities. Under ipo TRL logs its rewards from the summed
  log-ratios where ours are length-averaged (the log-probabilities ipo takes), so only the loss
  is compared there.
- dpo sigmoid with label smoothing (cDPO): TRL 1.16's ``DPOTrainer`` applies ``label_smoothing``
  to robust and exo_pair only; cDPO's formula is ``CPOTrainer.cpo_loss``'s sigmoid, which, given
  the log-ratios policy − reference, is exactly DPO's with smoothing.
- simpo: ``CPOTrainer.get_batch_loss_metrics`` with loss_type simpo and cpo_alpha 0.
- orpo: ``ORPOTrainer.get_batch_loss_metrics``. TRL's NLL term is the mean over every chosen
  token of the batch, prompt tokens included; ours is each pair's mean over its chosen
  completion, so that the loss is a mean over pairs. The two agree, by design only there, when
  the chosen completions are equally long and the prompt is one token (never a target): this case
  is built so.

The module is alone in importing TRL (about 1 to 3 s on top of transformers)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from neuron_parallel.config import PreferenceConfig
from neuron_parallel.preference import pair_stats, sequence_logps, stats_row

# CPO and ORPO live in trl.experimental, whose import warns that its API may change (the pin covers it).
pytestmark = pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")

PAIRS, VOCAB, IGNORE = 6, 11, -100
ACCELERATOR = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)
TRL_NAMES = {  # ours: TRL's logged name
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "rewards_accuracy": "rewards/accuracies",
    "rewards_margin": "rewards/margins",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
}


def _pairs(seed: int, *, equal_chosen: bool = False) -> SimpleNamespace:
    """``PAIRS`` pairs as TRL lays them out, chosen sequences first then rejected, right-padded to
    one length: ids, attention and completion masks, labels (the completion's ids), random logits,
    and each target's log-probability under them (0 where there is no target)."""
    g = torch.Generator().manual_seed(seed)

    def lengths(low, high):
        return torch.randint(low, high + 1, (PAIRS,), generator=g).tolist()

    prompts = [1] * PAIRS if equal_chosen else lengths(1, 4)
    chosen = [4] * PAIRS if equal_chosen else lengths(1, 6)
    rejected = lengths(1, 6)
    width = max(p + c for p, c in zip(prompts + prompts, chosen + rejected))
    ids = torch.randint(1, VOCAB, (2 * PAIRS, width), generator=g)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for i, (p, n) in enumerate(zip(prompts + prompts, chosen + rejected)):
        attention[i, : p + n] = 1
        completion[i, p : p + n] = 1
    ids = ids * attention  # padding id 0
    labels = ids.masked_fill(completion == 0, IGNORE)
    logits = 3 * torch.randn(2 * PAIRS, width, VOCAB, generator=g)
    targets = labels[:, 1:]
    taken = logits[:, :-1].log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token_logps = torch.where(targets != IGNORE, taken, 0.0)
    reference = -torch.rand(2 * PAIRS, generator=g) * completion.sum(1) * 2.5  # summed, ~ -1.25 per token
    return SimpleNamespace(
        ids=ids,
        attention=attention,
        completion=completion,
        labels=labels,
        logits=logits,
        token_logps=token_logps,
        reference=reference,
    )


def _ours(objective: str, cfg: PreferenceConfig, pairs: SimpleNamespace, *, reference: bool) -> dict[str, float]:
    """Our mean per-pair values: pairs k and k + 1 share a row, each completion's token
    log-probabilities tagged with its sequence id (2j chosen, 2j + 1 rejected of the row's j-th
    pair), as the packed rows of training are."""
    tok, labelled = pairs.token_logps, pairs.labels[:, 1:] != IGNORE
    rows, seqs, refs = [], [], []
    for r in range(0, PAIRS, 2):
        parts = [(r + j, side) for j in range(2) for side in (0, 1)]
        rows.append(torch.cat([tok[k + side * PAIRS] for k, side in parts]))
        seqs.append(torch.cat([torch.where(labelled[k + side * PAIRS], 2 * (k - r) + side, -1) for k, side in parts]))
        refs.append([[pairs.reference[k + side * PAIRS] for side in (0, 1)] for k in (r, r + 1)])
    sums, counts = sequence_logps(torch.stack(rows), torch.stack(seqs))
    ref = None
    if reference:
        ref = torch.zeros_like(sums)
        ref[:, :2] = torch.tensor(refs)
    stats = pair_stats(objective, cfg, sums, counts, ref)
    assert int((counts[..., 0] > 0).sum()) == PAIRS
    return stats_row(stats.tolist(), PAIRS)


def _stub_model(pairs: SimpleNamespace, *, fused: bool):
    """A causal LM that returns ``pairs``' logits, or (``fused``: DPOTrainer's fused lm_head
    call) the log-probability of each next-token label, 0 where the label is -100."""

    def forward(input_ids, attention_mask=None, use_cache=False, labels=None, fused_lm_head=False):
        assert torch.equal(input_ids, pairs.ids)
        if not fused:
            return SimpleNamespace(logits=pairs.logits)
        assert fused_lm_head and torch.equal(labels, pairs.labels)
        zeros = torch.zeros_like(pairs.token_logps)
        return SimpleNamespace(log_probs=pairs.token_logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    return forward


def _trl_dpo(cfg: PreferenceConfig, pairs: SimpleNamespace) -> dict[str, float]:
    """``DPOTrainer._compute_loss`` with precomputed reference log-probabilities: its loss and
    the rewards and log-probabilities it logs."""
    from trl.trainer.dpo_trainer import DPOTrainer

    trainer = object.__new__(DPOTrainer)
    trainer.__dict__.update(
        model=SimpleNamespace(training=True),
        accelerator=ACCELERATOR,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[cfg.loss_type],
        loss_weights=[1.0],
        beta=cfg.beta,
        label_smoothing=cfg.label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": pairs.ids,
        "attention_mask": pairs.attention,
        "completion_mask": pairs.completion,
        "ref_chosen_logps": pairs.reference[:PAIRS],
        "ref_rejected_logps": pairs.reference[PAIRS:],
    }
    loss = trainer._compute_loss(_stub_model(pairs, fused=True), inputs, return_outputs=False)
    logged = trainer._metrics["train"]
    return {"loss": float(loss), **{ours: logged[trl][-1] for ours, trl in TRL_NAMES.items()}}


def _trl_cdpo(cfg: PreferenceConfig, pairs: SimpleNamespace) -> dict[str, float]:
    """``CPOTrainer.cpo_loss`` (sigmoid, with label smoothing) of the log-ratios policy − reference."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    trainer = object.__new__(CPOTrainer)
    trainer.__dict__.update(
        accelerator=ACCELERATOR, alpha=0.0, loss_type="sigmoid", beta=cfg.beta, label_smoothing=cfg.label_smoothing
    )
    ratios = pairs.token_logps.sum(1) - pairs.reference
    losses, chosen, rejected = trainer.cpo_loss(ratios[:PAIRS], ratios[PAIRS:])
    return {
        "loss": float(losses.mean()),
        "rewards_chosen": float(chosen.mean()),
        "rewards_rejected": float(rejected.mean()),
        "rewards_accuracy": float((chosen > rejected).float().mean()),
        "rewards_margin": float((chosen - rejected).mean()),
    }


def _trl_batch(pairs: SimpleNamespace) -> dict[str, torch.Tensor]:
    """The chosen and rejected halves as CPOTrainer and ORPOTrainer take a batch."""
    half = {"chosen": slice(0, PAIRS), "rejected": slice(PAIRS, 2 * PAIRS)}
    return {
        f"{side}_{name}": value[rows]
        for side, rows in half.items()
        for name, value in (("input_ids", pairs.ids), ("attention_mask", pairs.attention), ("labels", pairs.labels))
    }


def _trl_simpo(cfg: PreferenceConfig, pairs: SimpleNamespace) -> dict[str, float]:
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    trainer = object.__new__(CPOTrainer)
    trainer.__dict__.update(
        accelerator=ACCELERATOR,
        is_encoder_decoder=False,
        pad_token_id=0,
        aux_loss_enabled=False,
        cpo_alpha=0.0,
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=cfg.gamma,
        beta=cfg.beta,
        label_smoothing=cfg.label_smoothing,
    )
    loss, metrics = trainer.get_batch_loss_metrics(_stub_model(pairs, fused=False), _trl_batch(pairs))
    return {"loss": float(loss), **{ours: metrics[trl] for ours, trl in TRL_NAMES.items()}}


def _trl_orpo(cfg: PreferenceConfig, pairs: SimpleNamespace) -> dict[str, float]:
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    trainer = object.__new__(ORPOTrainer)
    trainer.__dict__.update(
        accelerator=ACCELERATOR, is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False, beta=cfg.beta
    )
    loss, metrics = trainer.get_batch_loss_metrics(_stub_model(pairs, fused=False), _trl_batch(pairs))
    return {"loss": float(loss), **{ours: metrics[trl] for ours, trl in TRL_NAMES.items()}}


CASES = {  # name: (objective, settings, TRL's code, compared beyond the loss)
    "dpo-sigmoid": ("dpo", PreferenceConfig(beta=0.1), _trl_dpo, tuple(TRL_NAMES)),
    "dpo-hinge": ("dpo", PreferenceConfig(beta=0.5, loss_type="hinge"), _trl_dpo, tuple(TRL_NAMES)),
    "dpo-ipo": ("dpo", PreferenceConfig(beta=0.4, loss_type="ipo"), _trl_dpo, ()),
    "dpo-robust-0.1": (
        "dpo",
        PreferenceConfig(beta=0.2, loss_type="robust", label_smoothing=0.1),
        _trl_dpo,
        tuple(TRL_NAMES),
    ),
    "dpo-sigmoid-0.2": (
        "dpo",
        PreferenceConfig(beta=0.3, label_smoothing=0.2),
        _trl_cdpo,
        ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin"),
    ),
    "simpo": ("simpo", PreferenceConfig(beta=2.0, gamma=0.5), _trl_simpo, tuple(TRL_NAMES)),
    "simpo-0.1": ("simpo", PreferenceConfig(beta=2.5, gamma=1.0, label_smoothing=0.1), _trl_simpo, tuple(TRL_NAMES)),
    "orpo": ("orpo", PreferenceConfig(beta=0.1), _trl_orpo, tuple(TRL_NAMES)),
}
RTOL = 2e-6
"""Both sides compute in fp32 and add in different orders."""


@pytest.mark.parametrize("name", list(CASES))
def test_objective_matches_trls_loss_code(name):
    objective, cfg, trl, compared = CASES[name]
    for seed in range(3):
        pairs = _pairs(seed, equal_chosen=objective == "orpo")
        ours = _ours(objective, cfg, pairs, reference=objective == "dpo")
        theirs = trl(cfg, pairs)
        for key in ("loss", *compared):
            # A margin is a difference of rewards: its rounding is relative to them, not to itself.
            scale = max(abs(theirs[key]), abs(theirs["rewards_chosen"]) if key == "rewards_margin" else 0.0, 1.0)
            assert abs(ours[key] - theirs[key]) <= RTOL * scale, (name, seed, key, ours[key], theirs[key])
