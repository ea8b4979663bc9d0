"""A row packed from several documents trains exactly like its documents one by one: attention
never crosses a document boundary and rotary positions restart with every document. Every
attention path that runs on CPU (the additive mask, FlexAttention's block mask forward, the
mask-free causal path of rows that need no mask) gives the explicit boolean mask's outputs, and
the loss taken a chunk of tokens at a time gives the full-logits loss and its gradients."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from neuron_parallel.batches import IGNORE_INDEX, Batch, causal_rows
from neuron_parallel.checkpoint.tensors import HFWeights
from neuron_parallel.models.causal_lm import (
    CausalLMStage,
    build_meta_model,
    causal_lm_loss,
    document_causal_mask,
    load_config,
    load_weights,
    loss_chunk_tokens,
    materialize,
)

LENGTHS = (7, 12, 9)  # three documents, then 4 padding positions (their own "document")
BLOCK = 32


def make_stage(path) -> CausalLMStage:
    config = load_config(path)
    stage = CausalLMStage(build_meta_model(config), range(config.num_hidden_layers), first=True, last=True)
    materialize(stage, torch.device("cpu"))
    load_weights(stage, HFWeights(path), tied=False)
    return stage


@pytest.fixture(scope="module")
def models(tiny_world):
    from transformers import AutoModelForCausalLM

    path = tiny_world["model"]
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    return make_stage(path).eval(), ref.eval()


def packed_row(vocab: int):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]
    pad = BLOCK - sum(LENGTHS)
    ids = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])
    positions = torch.cat([torch.arange(n) for n in (*LENGTHS, pad)])
    labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])
    labels = torch.cat([labels, torch.full((pad,), IGNORE_INDEX)])
    return docs, ids[None], positions[None], labels[None]


def per_token_losses(logits, labels):
    return F.cross_entropy(logits[0].float(), labels[0], ignore_index=IGNORE_INDEX, reduction="none")


@torch.no_grad()
def test_packed_row_loss_equals_its_documents_one_by_one(models):
    stage, ref = models
    docs, ids, positions, labels = packed_row(ref.config.vocab_size)
    packed = per_token_losses(stage(ids, positions), labels)
    alone = torch.cat([per_token_losses(ref(input_ids=d[None]).logits[:, :-1], d[None, 1:]) for d in docs])
    trained = labels[0] != IGNORE_INDEX
    assert int(trained.sum()) == sum(n - 1 for n in LENGTHS)
    diff = (packed[trained] - alone).abs() / alone.abs()
    assert diff.max().item() <= 1e-5, diff.max().item()
    # The summed loss the trainer normalises is the same sum.
    total = causal_lm_loss(stage(ids, positions), labels)
    assert torch.allclose(total, alone.sum(), rtol=1e-5)


@torch.no_grad()
def test_the_check_fails_when_attention_crosses_documents_or_positions_do_not_restart(models):
    stage, ref = models
    docs, ids, positions, labels = packed_row(ref.config.vocab_size)
    alone = torch.cat([per_token_losses(ref(input_ids=d[None]).logits[:, :-1], d[None, 1:]) for d in docs])
    trained = labels[0] != IGNORE_INDEX
    later = torch.arange(int(trained.sum())) >= LENGTHS[0] - 1  # tokens of the 2nd and 3rd documents
    # One causal stream over the row (no positions): later documents see earlier ones.
    crossing = per_token_losses(stage(ids), labels)[trained]
    assert ((crossing - alone).abs()[later]).max().item() > 1e-3
    # Positions that run on across the row are one long document to the mask as well.
    running = torch.arange(BLOCK)[None]
    assert document_causal_mask(running).all(-1).sum() == 1  # only the last query row sees everything
    assert ((per_token_losses(stage(ids, running), labels)[trained] - alone).abs()[later]).max().item() > 1e-3


def test_document_mask_is_causal_within_documents_only():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_causal_mask(positions)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


class BooleanMaskStage(CausalLMStage):
    """The reference: the explicit boolean mask of :func:`document_causal_mask` in every layer."""

    def document_mask(self, positions, dtype):
        return document_causal_mask(positions)


def reference(stage: CausalLMStage) -> CausalLMStage:
    ref = stage.__class__.__new__(BooleanMaskStage)
    ref.__dict__ = stage.__dict__  # the same modules and weights
    return ref


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def rows_of_documents(vocab: int, lengths: list[tuple[int, ...]], block: int = 64, seed: int = 1):
    """Rows of documents of ``lengths`` (padding after them is its own document), every position
    of the row labelled but a document's last, as packing labels them."""
    g = torch.Generator().manual_seed(seed)
    ids, positions, labels = [], [], []
    for row in lengths:
        pad = block - sum(row)
        pos = torch.cat([torch.arange(n) for n in (*row, pad) if n])
        lab = torch.randint(3, vocab, (block,), generator=g)
        ends = torch.cumsum(torch.tensor(row), 0) - 1
        lab[ends] = IGNORE_INDEX
        lab[sum(row) :] = IGNORE_INDEX
        ids.append(torch.randint(3, vocab, (block,), generator=g))
        positions.append(pos)
        labels.append(lab)
    return torch.stack(ids), torch.stack(positions), torch.stack(labels)


def test_causal_rows_are_those_whose_labels_lie_in_their_first_document():
    positions = np.array(
        [
            [0, 1, 2, 3, 4, 5],  # one document
            [0, 1, 2, 3, 0, 1],  # a document, then padding without labels
            [0, 1, 2, 0, 1, 2],  # two documents, the second labelled
            [0, 1, 2, 0, 1, 2],  # two documents, the second without labels
        ]
    )
    x = IGNORE_INDEX
    labels = np.array([[5, 6, 7, 8, 9, x], [5, 6, 7, x, x, x], [5, 6, x, 7, 8, x], [5, 6, x, x, x, x]])
    assert causal_rows(positions, labels) == (True, True, False, True)
    rows = causal_rows(positions, labels)
    t = torch.from_numpy(positions)
    assert not Batch(t, t, t, causal_rows=rows).causal
    assert [b.causal for b in Batch(t, t, t, causal_rows=rows).split(2)] == [True, False]
    assert Batch(t, t).causal and not Batch(t, t, t).causal  # a stream; rows of unknown documents


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@torch.no_grad()
def test_every_cpu_attention_path_matches_the_explicit_mask(models):
    stage, _ = models
    vocab = stage.config.vocab_size
    ids, positions, _ = rows_of_documents(vocab, [(20, 30, 14), (64,), (9, 40), (1, 63)])
    expected = reference(stage)(ids, positions)
    # the additive mask, built once per forward (fp32, and bf16 under autocast)
    assert rel(stage(ids, positions), expected) <= 1e-6
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert stage.document_mask(positions, torch.float32).dtype == torch.bfloat16
        assert rel(stage(ids, positions), reference(stage)(ids, positions)) <= 1e-6
    # FlexAttention with the document block mask, grouped K/V as they are (eager: forward only on CPU)
    assert stage.config.num_attention_heads != stage.config.num_key_value_heads
    stage.flex_attention = True
    try:
        flex = stage(ids, positions)
    finally:
        stage.flex_attention = None
    assert rel(flex, expected) <= 1e-5, rel(flex, expected)


@torch.no_grad()
def test_rows_that_need_no_mask_take_the_causal_path_exactly(models):
    """Causal rows (one document, or one followed by padding or unlabelled documents) through the
    mask-free path, as the engine runs them (``mask_documents = False``, the positions kept for
    rotary positions), and through the stream path without positions: every labelled
    position's logits are the masked path's."""
    stage, _ = models
    ids, positions, labels = rows_of_documents(stage.config.vocab_size, [(64,), (40,), (25,), (64,)])
    labels[3, 30:] = IGNORE_INDEX
    positions[3] = torch.cat([torch.arange(30), torch.arange(34)])  # a second document without labels
    rows = causal_rows(positions.numpy(), labels.numpy())
    assert Batch(ids, labels, positions, causal_rows=rows).causal
    masked = reference(stage)(ids, positions)
    stage.mask_documents = False
    try:
        causal = stage(ids, positions)
    finally:
        stage.mask_documents = True
    trained = labels != IGNORE_INDEX
    for out in (causal, stage(ids)):
        assert rel(out[trained], masked[trained]) <= 1e-6
        assert torch.allclose(causal_lm_loss(out, labels), causal_lm_loss(masked, labels), rtol=1e-6)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_chunked_loss_equals_the_full_logits_loss_and_its_gradients(tiny_world, autocast):
    """Equal loss (1e-6 relative) and gradients (to 5e-6 of each one's largest element). Under
    bf16 autocast the lm_head's weight gradient is a sum of one bf16 matmul per chunk instead of
    one bf16 matmul: as close to the fp32 gradient as the full-logits one is (both within bf16
    rounding), every other gradient the same."""
    stage = make_stage(tiny_world["model"]).train()
    vocab = stage.config.vocab_size
    ids, positions, labels = rows_of_documents(vocab, [(20, 30, 14), (64,), (9, 40)], seed=2)

    def run(chunked: bool, bf16: bool):
        stage.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if chunked:
                stage.return_logits = False
                stage.loss_chunk_bytes = 4 * vocab * 50  # 50 tokens a chunk: 4 chunks of 192 tokens
                loss = stage.loss(stage(ids, positions), labels)
            else:
                stage.return_logits = True
                loss = causal_lm_loss(stage(ids, positions), labels)
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in stage.named_parameters()}

    assert loss_chunk_tokens(vocab, 4 * vocab * 50) == 50
    _, fp32_grads = run(chunked=False, bf16=False)
    full_loss, full_grads = run(chunked=False, bf16=autocast)
    chunk_loss, chunk_grads = run(chunked=True, bf16=autocast)
    assert abs(chunk_loss / full_loss - 1) <= 1e-6, (chunk_loss, full_loss)
    head = {"lm_head.weight"} if autocast else set()
    worst = max(set(full_grads) - head, key=lambda n: rel(chunk_grads[n], full_grads[n]))
    assert rel(chunk_grads[worst], full_grads[worst]) <= 5e-6, worst  # the lm_head's: fp32 sums in another order
    for n in head:
        assert rel(chunk_grads[n], fp32_grads[n]) <= 1.5 * rel(full_grads[n], fp32_grads[n])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # eval: no recompute
        assert abs(stage.loss(stage(ids, positions), labels) / full_loss - 1) <= 1e-6
