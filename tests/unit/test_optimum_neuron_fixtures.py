"""Checkpoints written by optimum-neuron's own save code (tests/fixtures/optimum-neuron, see its
README) consolidate to exactly what optimum-neuron's own consolidation wrote beside them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from neuron_parallel.checkpoint import export_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "optimum-neuron"
VARIANTS = sorted(p.name.removeprefix("ckpt_tp2_") for p in FIXTURES.glob("ckpt_tp2_*"))


def test_every_variant_is_here():
    assert VARIANTS == ["base", "gqa_fuseqkv", "xser_optim"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_consolidation_equals_optimum_neurons_bit_for_bit(variant, tmp_path):
    out = export_checkpoint(FIXTURES / f"ckpt_tp2_{variant}", tmp_path / "hf")
    ours = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        ours.update(load_file(f))
    reference = load_file(FIXTURES / f"consolidated_{variant}" / "model.safetensors")
    assert sorted(ours) == sorted(reference)
    for name, ref in reference.items():
        assert ours[name].dtype == ref.dtype and ours[name].shape == ref.shape, name
        assert torch.equal(ours[name].view(torch.uint8), ref.view(torch.uint8)), name
