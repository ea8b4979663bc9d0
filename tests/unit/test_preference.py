"""Preference rows and objectives: TRL's tokenization rule, pairs packed as two documents with the
prompt masked, truncation and drop counts, refusals, and each objective's loss against formulas
written out here from the papers (per pair, plain Python floats)."""

import json
import math

import numpy as np
import pytest
import torch

from neuron_parallel.config import DataConfig, PreferenceConfig
from neuron_parallel.pairs import fit_pair
from neuron_parallel.preference import pair_stats, sequence_logps


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


PAIRS = [
    {"prompt": f"Question {i} about lists?", "chosen": " See the docs.", "rejected": f" noise words {i}"}
    for i in range(12)
]


def _other_weights(tiny_world, d):
    """The tiny model with one weight changed: another model to the reference's digest."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = d / "other-model"
    shutil.copytree(tiny_world["model"], model)
    tensors = load_file(model / "model.safetensors")
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return str(model)


def test_a_reference_of_another_model_or_other_rows_is_refused_before_any_weight_loads(
    tiny_world, tmp_path, world_of_one
):
    from datasets import load_from_disk

    from neuron_parallel.checkpoint.format import base_model_identity
    from neuron_parallel.config import DataConfig, JobConfig, ParallelConfig, TrainConfig
    from neuron_parallel.preference import REFERENCE_RECORD, check_reference, compute_reference, reference_dir
    from neuron_parallel.train import train_job

    model = tiny_world["model"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    rows = _tokenize(tiny_world, tmp_path / "a", PAIRS, block_size=64, eval_fraction=0.25)
    ref = compute_reference(model, rows.path, rows.eval_path)
    check_reference(ref, model, rows.path, rows.eval_path)  # its own model and rows: accepted

    other_model = _other_weights(tiny_world, tmp_path)
    with pytest.raises(ValueError, match=r"job reference_path=.*model_path=.*\(model.name_or_path\).*other weights"):
        check_reference(ref, other_model, rows.path, rows.eval_path)
    other_rows = _tokenize(tiny_world, tmp_path / "b", PAIRS, block_size=48, eval_fraction=0.25)
    with pytest.raises(ValueError, match=r"its train values are those of other rows.*rerun the reference step"):
        check_reference(ref, model, other_rows.path, other_rows.eval_path)
    with pytest.raises(ValueError, match=r"holds no reference.json"):
        check_reference(tmp_path, model, rows.path, None)

    # Training refuses it on every rank before the engine is built: nothing is written.
    run = tmp_path / "run"
    job = JobConfig(
        model_path=other_model,
        dataset_path=rows.path,
        eval_dataset_path=rows.eval_path,
        reference_path=str(ref),
        output_dir=str(run),
        data=DataConfig(block_size=64, format="preference"),
        parallel=ParallelConfig.for_world(1),
        train=TrainConfig(objective="dpo", max_steps=1, global_batch_size=2, micro_batch_size=2),
    )
    with pytest.raises(ValueError, match=r"job reference_path=.*rerun the reference step"):
        train_job(job)
    assert not run.exists()

    # The reference step recomputes a folder whose record is not these rows' (rows rewritten in place).
    values = load_from_disk(str(ref / "train"))[:]
    record = json.loads((ref / REFERENCE_RECORD).read_text())
    record["rows"]["train"]["num_rows"] += 1
    (ref / REFERENCE_RECORD).write_text(json.dumps(record))
    assert (
        compute_reference(model, rows.path, rows.eval_path)
        == ref
        == reference_dir(rows.path, base_model_identity(model)["sha256"])
    )
    check_reference(ref, model, rows.path, rows.eval_path)
    assert load_from_disk(str(ref / "train"))[:] == values


def _reference_pair_rows(table, *, block_size, pad_id, one_per_row):
    """``pair_rows`` written pair by pair in plain Python, as the module docstring states it."""
    import pyarrow as pa

    cols = {n: table.column(n).to_pylist() for n in ("prompt", "chosen", "rejected")}
    units, truncated = [], []
    for p, ch, rj in zip(cols["prompt"], cols["chosen"], cols["rejected"]):
        cut = fit_pair(len(p), len(ch), len(rj), block_size)
        if cut is not None:
            units.append((p[cut:], ch, rj))
            truncated.append(cut > 0)
    rows, used = [], block_size + 1
    for i, (p, ch, rj) in enumerate(units):
        n = 2 * len(p) + len(ch) + len(rj)
        if one_per_row or used + n > block_size:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    shape = (len(rows), block_size)
    ids, labels = np.full(shape, pad_id), np.full(shape, -100)
    seq, positions = np.full(shape, -1), np.zeros(shape, dtype=np.int64)
    counts = {k: np.zeros(len(rows), dtype=np.int64) for k in ("_kept", "_truncated", "_tokens", "_trained")}
    for r, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members):
            p, *completions = units[i]
            for s, comp in enumerate(completions):
                doc = np.asarray(p + comp)
                ids[r, at : at + len(doc)], positions[r, at : at + len(doc)] = doc, np.arange(len(doc))
                labels[r, at + len(p) - 1 : at + len(doc) - 1] = doc[len(p) :]
                seq[r, at + len(p) - 1 : at + len(doc) - 1] = 2 * k + s
                at += len(doc)
                counts["_trained"][r] += len(comp)
            counts["_kept"][r] += 1
            counts["_truncated"][r] += truncated[i]
        positions[r, at:] = np.arange(block_size - at)
        counts["_tokens"][r] = at
    arrays = {"input_ids": ids, "labels": labels, "position_ids": positions, "sequence_ids": seq}
    fixed = {
        k: pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1).astype(np.int32)), block_size)
        for k, v in arrays.items()
    }
    return pa.table({**fixed, **{k: pa.array(v) for k, v in counts.items()}})


@pytest.mark.parametrize("one_per_row", [False, True])
@pytest.mark.parametrize("fill_min_rows", [256, 1])
def test_pair_rows_equal_the_pair_by_pair_rule(one_per_row, fill_min_rows, monkeypatch):
    """Varied pairs (fitting, truncated, dropped; prompts of one token up) in batches of several
    Arrow chunks: the same rows, labels, sequence ids and counts, bit for bit, whether the rows are
    filled on one thread or in ranges on several (``packing.fill_rows``)."""
    import pyarrow as pa

    from neuron_parallel import packing
    from neuron_parallel.pairs import pair_rows

    monkeypatch.setattr(packing, "FILL_MIN_ROWS", fill_min_rows)
    monkeypatch.setattr(packing, "usable_cores", lambda: 4)  # four ranges

    rng = np.random.default_rng(0)
    for block_size in (8, 13, 64):
        lengths = rng.integers(1, block_size, size=(120, 3))
        lengths[::7, 0] = block_size  # long prompts: truncated, or dropped with long completions
        pairs = [[rng.integers(0, 500, size=n).tolist() for n in row] for row in lengths]
        chunks = [pairs[:50], pairs[50:51], pairs[51:]]
        table = pa.Table.from_batches(
            [pa.RecordBatch.from_pydict(dict(zip(("prompt", "chosen", "rejected"), zip(*part)))) for part in chunks]
        )
        kw = dict(block_size=block_size, pad_id=3, one_per_row=one_per_row)
        got, want = pair_rows(table, **kw), _reference_pair_rows(table, **kw)
        assert got.schema == want.schema and got.equals(want), block_size
        counts = {k: sum(want.column(k).to_pylist()) for k in ("_kept", "_truncated")}
        assert counts["_kept"] < len(pairs) and counts["_truncated"] > 0  # both rules were exercised
    assert pair_rows(table.slice(0, 0), **kw).num_rows == 0


def test_pair_rows_predict_nothing_across_documents_after_an_empty_prompt():
    """An empty prompt (a string pair without BOS): each completion's first token has no position
    before it in its document, so it is no target, and nothing is labelled in the document before."""
    import pyarrow as pa

    from neuron_parallel.pairs import pair_rows

    table = pa.table({"prompt": [[], [7]], "chosen": [[1, 2], [4]], "rejected": [[5, 6, 9], [8]]})
    rows = pair_rows(table, block_size=16, pad_id=0, one_per_row=False).to_pydict()
    assert rows["input_ids"][0][:9] == [1, 2, 5, 6, 9, 7, 4, 7, 8]
    assert rows["position_ids"][0][:10] == [0, 1, 0, 1, 2, 0, 1, 0, 1, 0]
    assert rows["labels"][0][:9] == [2, -100, 6, 9, -100, 4, -100, 8, -100]
    assert rows["sequence_ids"][0][:9] == [0, -1, 1, 1, -1, 2, -1, 3, -1]
    assert rows["_trained"] == [5] and rows["_tokens"] == [9] and rows["_kept"] == [2]
