"""Preference rows and objectives: TRL's tokenization rule, pairs packed as two documents with the
prompt masked, truncation and drop counts, refusals, and each objective's loss against formulas
written out here from the papers (per pair, plain Python floats)."""

import json
import math

import numpy as np
import pytest
import torch

from neuron_parallel.config import DataConfig, PreferenceConfig
from neuron_parallel.preference import fit_pair, pair_stats, sequence_logps


def _tokenize(tiny_world, tmp_path, rows, **fields):
    from neuron_parallel.data import tokenize_data

    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields.setdefault("block_size", 64)
    return tokenize_data(
        DataConfig(source=str(src), format="preference", cache_dir=str(tmp_path), **fields), tiny_world["model"]
    )


def _rows(ds):
    from datasets import load_from_disk

    return load_from_disk(ds.path).with_format("numpy")[:]


def test_string_pairs_follow_trls_tokenize_row_and_mask_the_prompt(tiny_world, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world["model"])
    pair = {"prompt": "How does try work?", "chosen": " See the docs.", "rejected": " random words here"}
    ds = _tokenize(tiny_world, tmp_path, [pair] * 3, block_size=128)
    rows = _rows(ds)
    prompt = [tok.bos_token_id] + tok(pair["prompt"], add_special_tokens=False)["input_ids"]
    chosen = tok(pair["chosen"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rejected = tok(pair["rejected"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    first, second = prompt + chosen, prompt + rejected
    ids, labels, seq = rows["input_ids"][0], rows["labels"][0], rows["sequence_ids"][0]
    assert ids[: len(first)].tolist() == first and ids[len(first) : len(first) + len(second)].tolist() == second
    # Labelled exactly the completion (with EOS) of each document, tagged by its sequence id.
    assert labels[len(prompt) - 1 : len(first) - 1].tolist() == chosen
    assert (labels[: len(prompt) - 1] == -100).all() and labels[len(first) - 1] == -100
    assert (seq[labels != -100][: len(chosen)] == 0).all() and (
        seq[labels != -100][len(chosen) :][: len(rejected)] == 1
    ).all()
    # Three pairs packed in one row: sequence ids 0..5; the audit counts pairs.
    assert ds.num_blocks == 1 and sorted(set(seq.tolist()) - {-1}) == list(range(6))
    assert ds.audit["pairs"] == ds.audit["kept"] == 3 and ds.audit["dropped"] == 0


def test_long_pairs_lose_prompt_tokens_from_the_start_or_are_dropped(tiny_world, tmp_path):
    assert (
        fit_pair(10, 5, 5, 30) == 0
        and fit_pair(10, 5, 5, 28) == 1
        and fit_pair(10, 5, 5, 12) == 9
        and fit_pair(10, 5, 5, 11) is None
    )
    long_prompt = " ".join(["word"] * 40)
    rows = [
        {"prompt": long_prompt, "chosen": "yes", "rejected": "no"},
        {"prompt": "q", "chosen": " ".join(["a"] * 40), "rejected": " ".join(["b"] * 40)},
        {"prompt": "q", "chosen": "yes", "rejected": "no"},
    ]
    ds = _tokenize(tiny_world, tmp_path, rows, block_size=48, packing=False)
    assert ds.audit["pairs"] == 3 and ds.audit["kept"] == 2 and ds.audit["truncated"] == 1
    assert ds.audit["dropped"] == 1
    first = _rows(ds)
    assert (first["position_ids"][0] == 0).sum() >= 2  # both documents of the truncated pair


@pytest.mark.parametrize(
    "row, needle",
    [
        ({"prompt": "q", "chosen": "", "rejected": "no"}, "chosen completion (column 'chosen') is empty"),
        ({"prompt": "q", "better": "a", "rejected": "no"}, "set data.chosen_field"),
    ],
)
def test_missing_columns_and_empty_completions_are_refused(tiny_world, tmp_path, row, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _tokenize(tiny_world, tmp_path, [row])


def test_chat_pairs_render_the_prompt_with_the_generation_prompt(tiny_world, tmp_path):
    from transformers import AutoTokenizer

    from neuron_parallel.tiny import TEMPLATES

    template = TEMPLATES / "chatml.jinja"
    tok = AutoTokenizer.from_pretrained(tiny_world["model"])
    prompt = [{"role": "user", "content": "Explain lists."}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "See the docs."}], "rejected": "noise words"}
    ds = _tokenize(tiny_world, tmp_path, [row], chat_template=str(template), block_size=128)
    r = _rows(ds)
    head = tok.apply_chat_template(
        prompt, chat_template=template.read_text(), tokenize=False, add_generation_prompt=True
    )
    head_ids = tok(head, add_special_tokens=False)["input_ids"]
    ids, labels = r["input_ids"][0], r["labels"][0]
    assert ids[: len(head_ids)].tolist() == head_ids
    text = tok.decode(labels[labels != -100][: (r["sequence_ids"][0] == 0).sum()].tolist())
    assert text.startswith("See the docs.") and "<|im_end|>" in text


def test_segment_sums_per_completion():
    token = torch.tensor([[0.0, -1.0, -2.0, 0.0, -3.0, -4.0, -5.0, 0.0]])
    seq = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1]])
    sums, counts = sequence_logps(token, seq)
    assert sums[0, 0].tolist() == [-3.0, -12.0] and counts[0, 0].tolist() == [2.0, 3.0]
    assert counts[0, 1:].sum() == 0


def _logsig(x):
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def _independent(objective, cfg, pc, pr, rc, rr, nc, nr):
    """One pair's loss and rewards from the papers: DPO eq. 7 (with cDPO smoothing), IPO eq. 17,
    SLiC's hinge, robust DPO eq. 9, SimPO eq. 6, ORPO eqs. 6-7 (NLL per token of the chosen)."""
    b, e = cfg.beta, cfg.label_smoothing
    if objective == "dpo":
        if cfg.loss_type == "ipo":
            pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
        h = (pc - rc) - (pr - rr)
        loss = {
            "sigmoid": -(1 - e) * _logsig(b * h) - e * _logsig(-b * h),
            "robust": (-(1 - e) * _logsig(b * h) + e * _logsig(-b * h)) / (1 - 2 * e),
            "hinge": max(0.0, 1 - b * h),
            "ipo": (h - 1 / (2 * b)) ** 2,
        }[cfg.loss_type]
        return loss, b * (pc - rc), b * (pr - rr)
    ac, ar = pc / nc, pr / nr
    if objective == "simpo":
        m = b * ac - b * ar - cfg.gamma
        return -(1 - e) * _logsig(m) - e * _logsig(-m), b * ac, b * ar
    odds = lambda a: a - math.log(1 - math.exp(a))  # noqa: E731
    return -ac - b * _logsig(odds(ac) - odds(ar)), b * ac, b * ar


CASES = [
    ("dpo", PreferenceConfig(beta=0.1)),
    ("dpo", PreferenceConfig(beta=0.3, label_smoothing=0.2)),
    ("dpo", PreferenceConfig(beta=0.2, loss_type="robust", label_smoothing=0.1)),
    ("dpo", PreferenceConfig(beta=0.5, loss_type="hinge")),
    ("dpo", PreferenceConfig(beta=0.4, loss_type="ipo")),
    ("simpo", PreferenceConfig(beta=2.0, gamma=0.5)),
    ("orpo", PreferenceConfig(beta=0.1)),
]


@pytest.mark.parametrize("objective, cfg", CASES, ids=[f"{o}-{c.loss_type}-{c.label_smoothing}" for o, c in CASES])
def test_objectives_match_the_papers_formulas(objective, cfg):
    rng = np.random.default_rng(0)
    rows, slots = 3, 8
    n = rng.integers(1, 6, size=(rows, slots // 2, 2)).astype(np.float32)
    n[2, 1:] = 0  # row 2 holds one pair only: empty slots are no pairs
    n[:, :, 1] = np.where(n[:, :, 0] == 0, 0, n[:, :, 1])
    sums = -rng.uniform(0.5, 3.0, size=n.shape).astype(np.float32) * n
    ref = -rng.uniform(0.5, 3.0, size=n.shape).astype(np.float32) * n
    got = pair_stats(
        objective, cfg, torch.tensor(sums), torch.tensor(n), torch.tensor(ref) if objective == "dpo" else None
    )
    want = np.zeros(6)
    for r in range(rows):
        for k in range(slots // 2):
            if n[r, k, 0] == 0:
                continue
            loss, wc, wr = _independent(objective, cfg, *sums[r, k], *ref[r, k], *n[r, k])
            avg = objective != "dpo" or cfg.loss_type == "ipo"
            lc, lr = (sums[r, k] / n[r, k]) if avg else sums[r, k]
            want += [loss, wc, wr, float(wc > wr), lc, lr]
    assert np.allclose(got.numpy(), want, rtol=1e-5, atol=1e-5), (got, want)
