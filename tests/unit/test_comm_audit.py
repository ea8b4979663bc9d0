"""In one process (gloo, a world of one): the collective log sees plain ``torch.distributed`` calls
and functional collectives with their bytes and groups, and the gradient reducer starts its
buckets from backward's hooks (the last micro-batch only) with the same result as reducing after
backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from neuron_parallel.parallel.data_parallel import GradReducer, plan_buckets
from neuron_parallel.testing.comm_audit import CollectiveLog


def test_log_records_plain_and_functional_collectives_with_bytes(world_of_one):
    log = CollectiveLog({(0,): "dp"})
    with log:
        with log.phase("grads"):
            dist.all_reduce(torch.ones(1000))
        dist.broadcast(torch.ones(10, dtype=torch.float64), src=0)
        funcol.all_gather_single(torch.ones(4, 3), 0, world_of_one).wait()
        torch.ones(3).add_(1)  # not a collective
    kinds = [(r.kind, r.nbytes, r.numel, r.phase, r.scalar) for r in log.records]
    assert kinds == [
        ("all_reduce", 4000, 1000, "grads", False),
        ("broadcast", 80, 10, "", True),
        ("all_gather", 48, 12, "", True),
    ]
    assert {r.axis for r in log.records} == {"self"}  # a group of one, whatever it is called


def test_buckets_are_reverse_order_capped_and_split_by_dtype():
    ps = [torch.nn.Parameter(torch.zeros(n, dtype=d)) for n, d in [(4, torch.float32)] * 3 + [(2, torch.float64)]]
    buckets = plan_buckets(ps, cap=32)
    assert [[id(p) for p in b] for b in buckets] == [[id(ps[3])], [id(ps[2]), id(ps[1])], [id(ps[0])]]


def _model_and_loss(seed: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    return model, lambda: model(x).square().sum()


def test_reducer_starts_buckets_in_backward_and_matches_reduction_after(world_of_one):
    """On a group of one the sum is the gradient itself: the overlapped reduction equals the one
    after backward, element for element, through several buckets."""
    model, loss = _model_and_loss(1)
    reducer = GradReducer(list(model.parameters()), world_of_one, 2, bucket_bytes=64 * 4)
    assert len(reducer.buckets) == 4
    loss().backward()  # an earlier micro-batch: not armed, nothing starts
    assert not reducer._inflight
    reducer.arm(1)
    loss().backward()
    assert len(reducer._inflight) == 4  # every bucket started from the hooks, during backward
    reducer.finish()
    overlapped = [p.grad.clone() for p in model.parameters()]

    twin, twin_loss = _model_and_loss(1)
    twin_loss().backward()
    twin_loss().backward()
    summed = [p.grad.clone() for p in twin.parameters()]
    GradReducer(list(twin.parameters()), world_of_one, 2, hooks=False).finish()
    for a, b, s in zip(overlapped, twin.parameters(), summed):
        assert torch.equal(b.grad, s)
        assert torch.equal(a, b.grad)


def test_reducer_counts_pipeline_microbatches_and_refuses_a_late_gradient(world_of_one):
    model, loss = _model_and_loss(2)
    reducer = GradReducer(list(model.parameters()), world_of_one, 2)
    reducer.arm(2)  # two microbatches' backward per parameter before the bucket is final
    loss().backward()
    assert not reducer._inflight
    loss().backward()
    assert len(reducer._inflight) == 1
    with pytest.raises(RuntimeError, match="after its bucket's reduction started"):
        loss().backward()
