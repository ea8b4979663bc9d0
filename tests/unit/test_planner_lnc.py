"""Logical NeuronCores (LNC): the planner's ranks per node and memory per rank follow
NEURON_LOGICAL_NC_CONFIG, as the Neuron runtime does (AWS: 8 physical NeuronCore-v3 per Trainium2
chip, grouped 2 or 1 per logical core; 16 chips and 96 GiB per chip on a trn2.48xlarge), and the
doctor's stack check holds a launch to it. Pure Python: no device, no process."""

import json

import pytest

from neuron_flows.tasks.config import FinetuneConfig
from neuron_parallel.config import LaunchConfig, ParallelConfig
from neuron_parallel.doctor import DoctorTarget, stack_checks
from neuron_parallel.planning.hardware import LNC_ENV, GiB, get_hardware, load_hardware
from neuron_parallel.planning.resolve import resolve_layout
from neuron_parallel.planning.search import search_layouts

from .test_planner import LLAMA_8B

LNC_CHECK = "stack: logical NeuronCores (LNC)"


@pytest.mark.parametrize(
    "lnc, ranks, memory, peak",
    [("2", 64, 24 * GiB, 667e12 / 4), ("1", 128, 12 * GiB, 667e12 / 8), (None, 64, 24 * GiB, 667e12 / 4)],
    ids=["lnc2", "lnc1", "unset"],
)
def test_trn2_ranks_and_memory_follow_the_lnc(monkeypatch, lnc, ranks, memory, peak):
    if lnc is None:
        monkeypatch.delenv(LNC_ENV, raising=False)
    else:
        monkeypatch.setenv(LNC_ENV, lnc)
    hw = get_hardware("trn2")  # the alias of trn2.48xlarge
    assert (hw.name, hw.ranks_per_node, hw.memory_per_rank) == ("trn2.48xlarge", ranks, memory)
    assert hw.peak_flops_per_rank == pytest.approx(peak)
    assert hw.peak_fp32_flops_per_rank == pytest.approx(181e12 / (ranks // 16))
    assert hw.ranks_per_node * hw.memory_per_rank == 16 * 96 * GiB  # the node's HBM, however it is split
    assert hw.intra_node_bw == pytest.approx(1e12 / (ranks // 16))  # a chip's NeuronLink over its ranks


def test_an_explicit_lnc_wins_and_kinds_without_logical_cores_ignore_the_variable(monkeypatch):
    monkeypatch.setenv(LNC_ENV, "1")
    assert get_hardware("trn2.48xlarge", lnc=2).ranks_per_node == 64
    assert get_hardware("trn3").ranks_per_node == 128  # 8 NeuronCore-v4 per chip too
    for kind in ("p5.48xlarge", "trn1.32xlarge"):
        assert get_hardware(kind) == get_hardware(kind, lnc=None)
        with pytest.raises(ValueError, match="no logical NeuronCore setting"):
            get_hardware(kind, lnc=1)
    assert get_hardware("cpu", 2).ranks_per_node == 2


@pytest.mark.parametrize("value", ["3", "two", "0"])
def test_a_value_the_runtime_does_not_take_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(LNC_ENV, value)
    with pytest.raises(ValueError, match=rf"{LNC_ENV}={value!r}.*one of \[1, 2\]"):
        get_hardware("trn2.48xlarge")


def test_a_yaml_kind_with_logical_cores_is_re_split(tmp_path, monkeypatch):
    path = tmp_path / "trn2-one-chip.yaml"
    path.write_text(
        "ranks_per_node: 4\nmemory_per_rank: 24GiB\npeak_flops_per_rank: 166.75e12\nintra_node_bw: 250e9\n"
        "inter_node_bw: 25e9\ndevice: neuron\ncores_per_chip: 8\nlnc: 2\n"
    )
    spec = load_hardware(path, register=False)
    one = spec.with_lnc(1)
    assert (one.ranks_per_node, one.memory_per_rank, one.lnc) == (8, 12 * GiB, 1)
    assert one.with_lnc(2) == spec
    path.write_text(path.read_text().replace("lnc: 2", "lnc: 3"))
    with pytest.raises(ValueError, match="lnc dividing cores_per_chip"):
        load_hardware(path, register=False)


def test_the_plan_fits_the_lncs_rank_memory(monkeypatch):
    """The same 8B job: at LNC=1 every rank has 12 GiB, and the chosen layout fits in that."""
    kw = dict(seq_len=4096, global_batch=256)
    monkeypatch.setenv(LNC_ENV, "2")
    lnc2 = search_layouts(LLAMA_8B, "trn2.48xlarge", **kw).best
    monkeypatch.setenv(LNC_ENV, "1")
    lnc1 = search_layouts(LLAMA_8B, "trn2.48xlarge", **kw).best
    assert lnc2.memory_per_rank_bytes <= 0.9 * 24 * GiB
    assert lnc1.memory_per_rank_bytes <= 0.9 * 12 * GiB < lnc2.memory_per_rank_bytes
    assert lnc1.tp * lnc1.pp * lnc1.dp == 128 and lnc2.tp * lnc2.pp * lnc2.dp == 64


def test_resolve_layout_plans_for_the_lnc_of_the_launch(monkeypatch, tmp_path):
    """The plan step's path: 128 ranks per node at LNC=1 get 12 GiB each, not 24 GiB."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    monkeypatch.setenv(LNC_ENV, "1")
    launch = LaunchConfig(device="neuron", nproc_per_node=128)
    resolved = resolve_layout(tmp_path, {}, launch=launch, hardware=None, seq_len=4096, global_batch_size=256)
    assert resolved.search.hardware.memory_per_rank == 12 * GiB
    assert resolved.chosen.memory_per_rank_bytes <= launch.memory_fraction * 12 * GiB


def _lnc_check(nproc: int) -> object:
    launch = LaunchConfig(device="neuron", nproc_per_node=nproc)
    target = DoctorTarget(launch=launch, parallel=ParallelConfig.for_world(nproc), hardware="trn2.48xlarge")
    (check,) = [c for c in stack_checks(target) if c.name == LNC_CHECK]
    return check


@pytest.mark.parametrize(
    "lnc, nproc, ok, says",
    [
        (None, 64, True, "unset (the runtime's default, 2): 64 ranks of 24 GiB"),
        ("1", 128, True, "=1: 128 ranks of 12 GiB"),
        (None, 128, False, "64 ranks of 24 GiB, but launch.nproc_per_node=128; use at most 64 ranks"),
        ("5", 64, False, f"{LNC_ENV}='5' is not a logical core size"),
    ],
)
def test_the_doctor_holds_the_launch_to_the_lnc(monkeypatch, lnc, nproc, ok, says):
    if lnc is None:
        monkeypatch.delenv(LNC_ENV, raising=False)
    else:
        monkeypatch.setenv(LNC_ENV, lnc)
    check = _lnc_check(nproc)
    assert check.ok is ok and says in check.detail, check


def test_the_doctor_refuses_an_inherited_core_range_and_an_unshared_neff_cache(monkeypatch, tmp_path):
    """NEURON_RT_VISIBLE_CORES inherited by every rank, and a NEFF cache no other node sees."""
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-63")
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "neff"))
    launch = LaunchConfig(device="neuron", nproc_per_node=64, nnodes=2, rdzv_endpoint="127.0.0.1:29400")
    target = DoctorTarget(launch=launch, parallel=ParallelConfig.for_world(128), hardware="trn2.48xlarge")
    checks = {c.name: c for c in stack_checks(target)}
    cores = checks["stack: NEURON_RT_VISIBLE_CORES"]
    assert not cores.ok and "unset it" in cores.detail
    cache = checks["stack: compile cache"]
    assert not cache.ok and "the other nodes do not see" in cache.detail, cache
    assert (tmp_path / "neff").is_dir()  # it was writable: sharing is what failed
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    monkeypatch.delenv("TORCH_NEURONX_NEFF_CACHE_DIR")
    checks = {c.name: c for c in stack_checks(target)}
    assert checks["stack: NEURON_RT_VISIBLE_CORES"].ok
    assert not checks["stack: compile cache"].ok and "is unset" in checks["stack: compile cache"].detail


def test_the_config_path_reaches_the_doctor_with_its_lnc(monkeypatch):
    """A trn2 run's config as the doctor gets it: its launch and the planner's kind at the LNC."""
    from neuron_flows.tasks.doctor import doctor_target

    monkeypatch.setenv(LNC_ENV, "1")
    config = FinetuneConfig.load(None, ["launch.device=neuron", "launch.nproc_per_node=128"])
    target = doctor_target(config, from_file=False)
    assert target.hardware == "trn2.48xlarge" and target.parallel.dp == 128
    assert _lnc_check(128).ok
