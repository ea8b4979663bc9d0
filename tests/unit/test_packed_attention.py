"""A row packed from several documents trains exactly like its documents one by one: attention
never crosses a document boundary and rotary positions restart with every document."""

import pytest
import torch
import torch.nn.functional as F

from neuron_parallel.batches import IGNORE_INDEX
from neuron_parallel.checkpoint.tensors import HFWeights
from neuron_parallel.models.causal_lm import (
    CausalLMStage,
    build_meta_model,
    causal_lm_loss,
    document_causal_mask,
    load_config,
    load_weights,
    materialize,
)

LENGTHS = (7, 12, 9)  # three documents, then 4 padding positions (their own "document")
BLOCK = 32


@pytest.fixture(scope="module")
def models(tiny_world):
    from transformers import AutoModelForCausalLM

    path = tiny_world["model"]
    config = load_config(path)
    meta = build_meta_model(config)
    stage = CausalLMStage(meta, range(config.num_hidden_layers), first=True, last=True)
    materialize(stage, torch.device("cpu"))
    load_weights(stage, HFWeights(path), tied=False)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    return stage.eval(), ref.eval()


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
