"""The hardware the planner can place a job on: one ``HardwareSpec`` per kind of node.

Peaks, memory and bandwidths come from the vendors' public specifications (AWS's Trainium and
EC2 instance pages, NVIDIA's datasheets), each cited where it is set; bandwidths are nominal link
rates, and the planner's step-time model is only as good as they are; every collective also pays
a fixed latency per call and per ring step (``NCCL_RING_LATENCY``). Each kind has two peaks,
bf16 and fp32: the planner computes at the one of the precision the job runs
(``HardwareSpec.peak_flops``). ``efficiency`` (the fraction of the peak a large matmul reaches)
and ``reserved_bytes`` (runtime, collective-library buffers) are planning assumptions, stated as
such.

More kinds load from YAML (``load_hardware``; keys are the ``HardwareSpec`` field names, sizes
in bytes or with a GiB/GB/TB suffix); ``get_hardware`` accepts a catalog name or a YAML path.
The ``cpu`` kind describes this machine: one rank per core, memory from the OS.

Trainium2 and later group physical NeuronCores into logical ones (LNC): one rank per logical
core, so ranks per node, memory and peak per rank follow the LNC setting. ``get_hardware`` reads
it from ``NEURON_LOGICAL_NC_CONFIG`` (:data:`LNC_ENV`), the Neuron runtime's own variable, as the
ranks of the job will (``HardwareSpec.with_lnc``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..utils import DEVICE_BACKENDS

GiB = 1 << 30
GB = 10**9

NCCL_RING_LATENCY = {"call": 8.4e-6, "link": 3.4e-6, "network": 14e-6}
"""The latency of a ring collective in NCCL's own cost model (NVIDIA/nccl, src/graph/tuning.cc:
ring algorithm, Simple protocol, ``baseLat`` 8.4 µs per call and ``hwLat`` 3.4 µs per step over
NVLink, 14 µs per step over the network; a ring all-gather or reduce-scatter over n ranks takes
n − 1 steps, an all-reduce 2(n − 1)). Every kind takes these figures unless its YAML sets its
own: neither AWS nor gloo publish a per-call or per-hop latency for Neuron collectives or CPU,
so there they are an assumption (a per-call floor of microseconds, as on GPUs; eager dispatch
may cost more)."""


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One kind of node: what a rank gets and how fast ranks talk to each other."""

    name: str
    ranks_per_node: int
    """Processes (torchrun ``--nproc_per_node``) per node: one per GPU or logical NeuronCore."""
    memory_per_rank: int
    """Device memory one rank can address, bytes."""
    peak_flops_per_rank: float
    """Dense bf16 FLOP/s of one rank (the MFU denominator of a bf16 run)."""
    intra_node_bw: float
    """Collective bus bandwidth per rank inside a node, bytes/s."""
    inter_node_bw: float
    """Network bandwidth of one node (shared by its ranks), bytes/s."""
    device: str
    """torch device type: cpu, cuda or neuron."""
    backend: str = ""
    """torch.distributed backend; follows from ``device`` when empty."""
    peak_fp32_flops_per_rank: float = 0.0
    """Dense FLOP/s of one rank for fp32 matmuls as the trainer runs them (TF32 tensor cores on
    CUDA, where the trainer enables TF32); 0 takes ``peak_flops_per_rank``."""
    efficiency: float = 0.4
    """Fraction of the peak (``peak_flops``) a large matmul reaches (planning assumption)."""
    reserved_bytes: int = 0
    """Device memory the runtime and collective libraries keep for themselves."""
    allocator_margin: float = 0.10
    """Fragmentation headroom added on top of the predicted tensor bytes."""
    planning_only: bool = False
    """True where this project cannot run (no TorchNeuron backend): plans are for reference."""
    cores_per_chip: int = 0
    """Physical NeuronCores per chip where they group into logical cores (Trainium2 and later);
    0 where no LNC setting applies."""
    lnc: int = 0
    """Physical NeuronCores per logical core (rank) the other figures are for; 0 where no LNC
    setting applies."""
    memory_bw: float = 0.0
    """Device memory (HBM) bandwidth of one rank, bytes/s: what an attention path that writes its
    scores to memory is bound by (``neuron_parallel.planning.timing``); 0 where not modelled."""
    call_latency: float = NCCL_RING_LATENCY["call"]
    """Seconds every collective call (or point-to-point send) pays whatever its size: launch and
    synchronisation (``neuron_parallel.planning.timing.collective_latency``)."""
    link_latency: float = NCCL_RING_LATENCY["link"]
    """Seconds per step of a ring collective between two ranks of one node (one hop of a chunk)."""
    network_latency: float = NCCL_RING_LATENCY["network"]
    """Seconds per step of a ring collective that crosses from one node to the next."""
    source: str = ""

    def __post_init__(self) -> None:
        if self.device not in DEVICE_BACKENDS:
            raise ValueError(f"hardware {self.name}: device {self.device!r} is not one of {sorted(DEVICE_BACKENDS)}")
        if not self.backend:
            object.__setattr__(self, "backend", DEVICE_BACKENDS[self.device])
        for field in ("ranks_per_node", "memory_per_rank", "peak_flops_per_rank", "intra_node_bw", "inter_node_bw"):
            if getattr(self, field) <= 0:
                raise ValueError(f"hardware {self.name}: {field} must be > 0, got {getattr(self, field)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"hardware {self.name}: efficiency must lie in (0, 1], got {self.efficiency}")
        if self.memory_bw < 0:
            raise ValueError(f"hardware {self.name}: memory_bw must be >= 0 (0: not modelled), got {self.memory_bw}")
        for field in ("call_latency", "link_latency", "network_latency"):
            if getattr(self, field) < 0:
                raise ValueError(f"hardware {self.name}: {field} must be >= 0 seconds, got {getattr(self, field)}")
        if self.peak_fp32_flops_per_rank < 0:
            raise ValueError(
                f"hardware {self.name}: peak_fp32_flops_per_rank must be >= 0 (0: as peak_flops_per_rank), "
                f"got {self.peak_fp32_flops_per_rank}"
            )
        if bool(self.cores_per_chip) != bool(self.lnc) or (self.lnc and self.cores_per_chip % self.lnc):
            raise ValueError(
                f"hardware {self.name}: cores_per_chip ({self.cores_per_chip}) and lnc ({self.lnc}) go together, "
                "lnc dividing cores_per_chip (e.g. 8 and 2 for Trainium2), or both 0"
            )

    def peak_flops(self, precision: str) -> float:
        """Dense FLOP/s of one rank at the planner's ``precision``: ``fp32`` runs its matmuls in
        fp32 (``peak_fp32_flops_per_rank``), ``bf16`` and ``bf16_autocast`` in bf16
        (``peak_flops_per_rank``)."""
        if precision == "fp32" and self.peak_fp32_flops_per_rank:
            return self.peak_fp32_flops_per_rank
        return self.peak_flops_per_rank

    def with_ranks(self, ranks_per_node: int) -> HardwareSpec:
        """The same kind with another rank count per node; for ``cpu`` the OS memory is re-split."""
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        memory = self.memory_per_rank
        if self.device == "cpu":
            memory = self.memory_per_rank * self.ranks_per_node // ranks_per_node
        return dataclasses.replace(self, ranks_per_node=ranks_per_node, memory_per_rank=memory)

    def with_lnc(self, lnc: int) -> HardwareSpec:
        """The same kind at another logical core size: ``lnc`` physical NeuronCores per rank. A rank
        gets ``lnc`` cores' share of its chip's memory, peaks and links, and a node has as many
        ranks as it has logical cores (trn2.48xlarge: 64 ranks of 24 GiB at LNC=2, 128 of 12 GiB
        at LNC=1)."""
        if not self.lnc:
            raise ValueError(f"hardware {self.name} has no logical NeuronCore setting; unset {LNC_ENV}")
        if lnc not in LNC_CHOICES or self.cores_per_chip % lnc:
            raise ValueError(
                f"{LNC_ENV}={lnc} is not a logical core size of {self.name}; use one of {list(LNC_CHOICES)}"
            )
        if lnc == self.lnc:
            return self
        ranks = self.ranks_per_node * self.lnc // lnc  # per chip: cores_per_chip / lnc
        return dataclasses.replace(
            self,
            lnc=lnc,
            ranks_per_node=ranks,
            memory_per_rank=self.memory_per_rank * lnc // self.lnc,
            peak_flops_per_rank=self.peak_flops_per_rank * lnc / self.lnc,
            peak_fp32_flops_per_rank=self.peak_fp32_flops_per_rank * lnc / self.lnc,
            intra_node_bw=self.intra_node_bw * lnc / self.lnc,
            memory_bw=self.memory_bw * lnc / self.lnc,
        )


LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
"""The Neuron runtime's logical core setting: how many physical NeuronCores form one logical
core, the unit a rank runs on (AWS Neuron documentation, "Logical NeuronCore configuration",
awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/logical-neuroncore-config.html).
Graphs must be compiled for the LNC the runtime runs."""
LNC_CHOICES = (1, 2)
"""The LNC sizes the Neuron SDK supports (AWS Neuron documentation, "Using Logical NeuronCores
(LNC) with NKI": an LNC degree of 1 or 2)."""
DEFAULT_LNC = 2
"""LNC on Trainium2 and later when ``NEURON_LOGICAL_NC_CONFIG`` is unset (the Neuron compiler's
default there, AWS Neuron documentation, compiler error code NCC_EVRF066)."""


def lnc_from_env(environ=None) -> int | None:
    """The LNC ``NEURON_LOGICAL_NC_CONFIG`` sets, or None when it is unset; a value other than
    1 or 2 is refused, naming the variable."""
    raw = (os.environ if environ is None else environ).get(LNC_ENV, "").strip()
    if not raw:
        return None
    if raw not in {str(c) for c in LNC_CHOICES}:
        raise ValueError(f"{LNC_ENV}={raw!r} is not a logical core size; set it to one of {list(LNC_CHOICES)}")
    return int(raw)


# Trainium: per-chip dense bf16 and FP32 peaks and memory from AWS's architecture pages (Trainium:
# 190 BF16/TF32 and 47.5 FP32 TFLOPS per chip; Trainium2: 667 and 181; Trainium3: 671 and 183);
# ranks are logical NeuronCores. fp32 is planned at the FP32 rate: no cast of fp32 matmuls to a
# narrower type is assumed.
# HBM bandwidth per chip: AWS Neuron architecture pages (Trainium 820 GB/s, Trainium2 2.9 TB/s,
# Trainium3 4.9 TB/s), split like the memory over the chip's ranks.
# NeuronLink and EFA rates: AWS Neuron architecture pages (trn1-arch: NeuronLink-v2 384 GiB/s per
# device, EFA 800 Gbps on trn1.32xlarge; trn2-arch: 16 chips in a 4x4 torus, NeuronLink-v3 about
# 1 TB/s per chip, EFAv3 3.2 Tbps per trn2.48xlarge; trainium3 page: NeuronLink-v4 2.56 TB/s per
# device, 16 chips per Trn3 Gen1 server). Per-rank bus bandwidth = per-chip link rate / ranks per
# chip. Trn3's EFA rate is not published there: 3.2 Tbps as on trn2 is an assumption.
# efficiency 0.40 for Trainium is an assumption; bench/planner.py compares the resulting
# tokens/s with AWS's published Neuron distributed-training throughput for Llama-3.1 8B and 70B.
_CATALOG: dict[str, HardwareSpec] = {}


def register_hardware(spec: HardwareSpec) -> HardwareSpec:
    """Add (or replace) a kind in the catalog; returns it."""
    _CATALOG[spec.name] = spec
    return spec


def _trainium(**fields) -> HardwareSpec:
    """A Trainium kind: the neuron device, and the planning assumptions shared by every one."""
    return HardwareSpec(device="neuron", efficiency=0.40, reserved_bytes=1 * GiB, **fields)


def _trainium_16_chips(
    name: str,
    *,
    chip_flops: float,
    chip_fp32_flops: float,
    chip_memory: int,
    chip_memory_bw: float,
    chip_link_bw: float,
    source: str,
):
    """A 16-chip Trainium node of 8 physical NeuronCores per chip, planned at ``DEFAULT_LNC``
    (2: 4 logical ranks per chip, 64 per node): each rank gets its share of its chip's peaks,
    memory and NeuronLink rate; 3.2 Tbps of EFA per node. ``HardwareSpec.with_lnc`` re-splits
    the chip for another LNC."""
    ranks_per_chip = 8 // DEFAULT_LNC
    return _trainium(
        name=name,
        ranks_per_node=16 * ranks_per_chip,
        memory_per_rank=chip_memory // ranks_per_chip,
        peak_flops_per_rank=chip_flops / ranks_per_chip,
        peak_fp32_flops_per_rank=chip_fp32_flops / ranks_per_chip,
        intra_node_bw=chip_link_bw / ranks_per_chip,
        memory_bw=chip_memory_bw / ranks_per_chip,
        inter_node_bw=3.2e12 / 8,
        cores_per_chip=8,
        lnc=DEFAULT_LNC,
        source=source,
    )


def _nvidia_8gpu(**fields) -> HardwareSpec:
    """An 8-GPU NVLink node of the p5 family. H100 SXM / H200 dense bf16 peak from NVIDIA's
    datasheets (989 TFLOP/s), and for fp32 matmuls their TF32 tensor-core peak (989 TFLOP/s with
    sparsity, half of it dense), which the trainer enables on CUDA; NVLink 4 is 900 GB/s
    bidirectional per GPU (450 GB/s each way); p5.48xlarge and p5en.48xlarge have 3200 Gbps of
    EFA (AWS EC2 P5 page). efficiency 0.55: published end-to-end
    MFU is 39-48 % (torchtitan, Megatron, LLM Foundry), so the matmuls alone run somewhat above."""
    return HardwareSpec(
        ranks_per_node=8,
        peak_flops_per_rank=989e12,
        peak_fp32_flops_per_rank=989e12 / 2,
        intra_node_bw=450e9,
        inter_node_bw=3.2e12 / 8,
        device="cuda",
        efficiency=0.55,
        reserved_bytes=2 * GiB,
        **fields,
    )


for _spec in (
    _trainium(
        name="trn1.32xlarge",
        ranks_per_node=32,
        memory_per_rank=16 * GiB,
        peak_flops_per_rank=95e12,
        peak_fp32_flops_per_rank=47.5e12 / 2,
        intra_node_bw=384 * GiB / 2,
        memory_bw=820e9 / 2,
        inter_node_bw=800e9 / 8,
        planning_only=True,
        source="AWS Trainium pages (190 TFLOP/s bf16, 47.5 fp32, 32 GiB at 820 GB/s per chip, 2 cores); "
        "AWS trn1-arch (NeuronLink-v2, EFA 800 Gbps); "
        "TorchNeuron supports trn2/trn3 only, so trn1 plans are for reference",
    ),
    _trainium_16_chips(
        "trn2.48xlarge",
        chip_flops=667e12,
        chip_fp32_flops=181e12,
        chip_memory=96 * GiB,
        chip_memory_bw=2.9e12,
        chip_link_bw=1e12,
        source="AWS Trainium pages (667 TFLOP/s bf16, 181 fp32, 96 GiB at 2.9 TB/s per chip); AWS Logical NeuronCore "
        "configuration (8 physical NeuronCore-v3 per Trainium2 chip: 4 ranks per chip at LNC=2, 8 at LNC=1); "
        "AWS trn2-arch (NeuronLink-v3, EFAv3 3.2 Tbps)",
    ),
    _trainium_16_chips(
        "trn3",
        chip_flops=671e12,
        chip_fp32_flops=183e12,
        chip_memory=144 * GiB,
        chip_memory_bw=4.9e12,
        chip_link_bw=2.56e12,
        source="AWS Trainium pages (671 TFLOP/s bf16, 183 fp32, 144 GiB at 4.9 TB/s per chip); AWS trainium3 page (8 "
        "NeuronCore-v4 per chip, so 4 ranks at LNC=2; NeuronLink-v4 2.56 TB/s; 16 chips per Gen1 server); "
        "EFA rate assumed as trn2",
    ),
    _nvidia_8gpu(
        name="p5.48xlarge",
        memory_per_rank=80 * GB,
        memory_bw=3.35e12,
        source="NVIDIA H100 SXM datasheet (989 TFLOP/s, 80 GB at 3.35 TB/s, NVLink 900 GB/s); AWS P5 (EFA 3200 Gbps)",
    ),
    _nvidia_8gpu(
        name="h200x8",
        memory_per_rank=141 * GB,
        memory_bw=4.8e12,
        source="NVIDIA H200 datasheet (989 TFLOP/s, 141 GB at 4.8 TB/s, NVLink 900 GB/s); AWS P5en (EFA 3200 Gbps)",
    ),
):
    register_hardware(_spec)
_ALIASES = {
    "trn1": "trn1.32xlarge",
    "trn2": "trn2.48xlarge",
    "p5": "p5.48xlarge",
    "h100x8": "p5.48xlarge",
    "p5en.48xlarge": "h200x8",
    "h200": "h200x8",
}


def cpu_hardware(ranks_per_node: int | None = None) -> HardwareSpec:
    """This machine: one rank per core (or ``ranks_per_node``), the physical memory split evenly.

    No figure here is published: the peak is nominal (cores × 2.5 GHz × 32 fp32 FLOP/cycle for
    AVX2 FMA), taken for bf16 as well (no faster bf16 unit is assumed); gloo over loopback is
    taken as ~2 GB/s per rank. Good for relative ranking only.
    """
    cores = os.cpu_count() or 1
    ranks = ranks_per_node or cores
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * GiB  # no sysconf (non-POSIX): a conservative guess
    peak = 2.5e9 * 32 * cores / ranks
    return HardwareSpec(
        name="cpu",
        ranks_per_node=ranks,
        memory_per_rank=total // ranks,
        peak_flops_per_rank=peak,
        peak_fp32_flops_per_rank=peak,
        intra_node_bw=2e9,
        inter_node_bw=1.25e9,
        device="cpu",
        efficiency=0.5,
        reserved_bytes=0,
        allocator_margin=0.0,
        source="this machine: os.cpu_count() ranks, physical memory from sysconf; nominal AVX2 peak",
    )


_SIZE = re.compile(r"^\s*([0-9.eE+-]+)\s*(GiB|GB|TiB|TB|MiB|MB)?\s*$")
_UNITS = {None: 1, "MiB": 1 << 20, "MB": 10**6, "GiB": GiB, "GB": GB, "TiB": 1 << 40, "TB": 10**12}


def _number(value) -> float:
    if isinstance(value, (int, float)):
        return value
    match = _SIZE.match(str(value))
    try:
        return float(match.group(1)) * _UNITS[match.group(2)]
    except (AttributeError, ValueError):  # no match, or no float (e.g. "3-4")
        raise ValueError(f"cannot read {value!r} as a number; write e.g. 16GiB, 400e9, 1.5TB or 3.4e-6") from None


def load_hardware(path: str | Path, *, register: bool = True) -> HardwareSpec:
    """Read a ``HardwareSpec`` from YAML (field names as keys) and, by default, add it to the catalog."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    fields = {f.name for f in dataclasses.fields(HardwareSpec)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{path}: unknown hardware keys {unknown}; valid keys: {sorted(fields)}")
    for key in ("memory_per_rank", "reserved_bytes"):
        if key in data:
            data[key] = int(_number(data[key]))
    floats = ("peak_flops_per_rank", "peak_fp32_flops_per_rank", "intra_node_bw", "inter_node_bw", "memory_bw")
    for key in floats + ("call_latency", "link_latency", "network_latency"):
        if key in data:
            data[key] = float(_number(data[key]))
    data.setdefault("name", Path(path).stem)
    spec = HardwareSpec(**data)
    return register_hardware(spec) if register else spec


def _yaml_dirs() -> list[Path]:
    """Folders whose ``*.yaml`` kinds are known by name: ``$NEURON_FLOWS_HARDWARE_DIR`` (``:``-
    separated), then the repository's ``configs/hardware``."""
    env = [Path(p) for p in os.environ.get("NEURON_FLOWS_HARDWARE_DIR", "").split(os.pathsep) if p]
    return [d for d in [*env, Path(__file__).resolve().parents[1] / "configs" / "hardware"] if d.is_dir()]


def _yaml_kinds() -> dict[str, Path]:
    return {p.stem: p for d in reversed(_yaml_dirs()) for p in sorted(d.glob("*.y*ml"))}


def hardware_names() -> list[str]:
    """Every kind ``get_hardware`` knows by name (catalog, YAML folders, ``cpu``)."""
    return sorted({*_CATALOG, *_yaml_kinds(), "cpu"})


def get_hardware(kind: str | HardwareSpec, ranks_per_node: int | None = None, lnc: int | None = None) -> HardwareSpec:
    """A catalog kind by name (or alias, or the stem of a YAML file in ``_yaml_dirs``), ``cpu``,
    or a YAML file path. A kind with logical NeuronCores is re-split for ``lnc``, by default the
    ``NEURON_LOGICAL_NC_CONFIG`` of this process (``lnc_from_env``), else its own; other kinds
    ignore the variable. ``ranks_per_node`` then overrides the kind's rank count (e.g.
    ``get_hardware("cpu", 2)``)."""
    if isinstance(kind, HardwareSpec):
        spec = kind
    elif kind == "cpu":
        return cpu_hardware(ranks_per_node)
    elif kind.endswith((".yaml", ".yml")) or os.sep in kind:
        spec = load_hardware(kind)
    else:
        name = _ALIASES.get(kind, kind)
        if name not in _CATALOG and name in _yaml_kinds():
            load_hardware(_yaml_kinds()[name])
        if name not in _CATALOG:
            raise ValueError(
                f"unknown hardware {kind!r}; use one of {hardware_names()} or a YAML file "
                "(see neuron_parallel.planning.hardware.load_hardware)"
            )
        spec = _CATALOG[name]
    if spec.lnc:
        spec = spec.with_lnc(lnc or lnc_from_env() or spec.lnc)
    elif lnc is not None:
        spec.with_lnc(lnc)  # raises: the kind has no logical cores
    return spec.with_ranks(ranks_per_node) if ranks_per_node else spec
