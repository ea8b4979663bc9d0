"""The stack part of ``neuron-flows doctor`` (``neuron_parallel.doctor``): the host's software and
settings, checked in this process with the device untouched; the job a host is checked for
(:class:`DoctorTarget`) and the :class:`Check` every part of the doctor returns."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import LaunchConfig, LoraConfig, ParallelConfig
from .planning.hardware import DEFAULT_LNC, LNC_ENV, get_hardware, lnc_from_env
from .planning.model import ModelShape

GiB = 1 << 30

NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
"""Where torch-neuronx keeps compiled graphs (NEFFs) across runs (AWS Neuron documentation,
"TorchNeuron environment variables" and "What are Neuron Compiler artifacts?"); unset, every
host and every pod compiles every graph again."""
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor (``torch.compile`` on cpu and cuda) caches compiled kernels; its default is a
folder of the temporary directory."""
VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"
"""The NeuronCores a process may reserve (AWS Neuron documentation, "Neuron Runtime
configuration"). torch-neuronx gives each rank the core of its LOCAL_RANK when it is unset;
inherited by every rank, a range makes them all claim the same cores."""
SHARED_FILESYSTEMS = frozenset({"nfs", "nfs4", "lustre", "ceph", "cifs", "smb3", "glusterfs", "gpfs", "beegfs"})
"""File system types whose contents every node sees (/proc/self/mounts names them so)."""


@dataclass(frozen=True, slots=True)
class DoctorTarget:
    """The job a host is checked for: its launch, its layout and what sizes it."""

    launch: LaunchConfig
    parallel: ParallelConfig
    hardware: str
    """The planner's hardware kind (logical cores per node on neuron)."""
    model_dir: str | None = None
    """The run's local model directory; None: none is known (the tiny model sizes the checks)."""
    model_name: str = ""
    """The run's model as the config names it (for messages when it is not local)."""
    seq_len: int = 128
    micro_batch_size: int = 1
    output_dir: str = "."
    """Where the run's checkpoints go (a ``{flow_run…}`` part is not there yet: its parent is checked)."""
    lora: LoraConfig | None = None
    optimizer: str = "adamw"
    work_dir: str = ".runs/doctor"
    """The parity smoke's tiny model, data and run directories (shared by every node when nnodes > 1)."""

    @classmethod
    def for_launch(cls, launch: LaunchConfig, hardware: str, **fields) -> DoctorTarget:
        """No run to check for: data parallelism over every rank, the tiny model's shapes."""
        world = launch.nproc_per_node * launch.nnodes
        return cls(launch=launch, parallel=ParallelConfig.for_world(world), hardware=hardware, **fields)

    @property
    def device(self) -> str:
        return self.launch.device

    def shape(self) -> ModelShape | None:
        """The run's model's shape (its config.json), the tiny model's when no model was named,
        None when it is named but not on this host."""
        if self.model_dir:
            return ModelShape.from_config(self.model_dir)
        if self.model_name:
            return None
        from .tiny import TINY_MODEL_SHAPE

        return ModelShape.from_config({**TINY_MODEL_SHAPE, "vocab_size": 2048, "_name_or_path": "the tiny Llama"})


@dataclass(frozen=True, slots=True)
class Check:
    """One check's outcome; ``detail`` says what was measured, or what failed and the fix."""

    name: str
    ok: bool
    detail: str
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "seconds": round(self.seconds, 3)}


def check(name: str, fn: Callable[[], str]) -> Check:
    """``fn``'s detail as a passed check, or its error as a failed one."""
    t0 = time.monotonic()
    try:
        return Check(name, True, fn(), time.monotonic() - t0)
    except Exception as e:  # a failed check names what failed; the other checks still run
        return Check(name, False, first_line(e), time.monotonic() - t0)


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (
        lines[0]
        if lines and isinstance(e, ValueError | AssertionError)
        else f"{type(e).__name__}: {lines[0] if lines else ''}"
    )


def check_present(device: str) -> None:
    """Refuse a device this host lacks (``ValueError`` naming the fix): no CUDA device, or no
    torch-neuronx or no Neuron device (/dev/neuron*). The device itself is not touched."""
    from .checks import check_device

    check_device(LaunchConfig(device=device))
    if device == "neuron" and not _neuron_devices():
        raise ValueError(
            "launch.device=neuron but this host has no Neuron device (/dev/neuron*); run on a Trainium host "
            "(with the Neuron driver loaded), or use --device cpu"
        )


def _neuron_devices() -> list[str]:
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def stack_checks(target: DoctorTarget) -> list[Check]:
    """The host's software and settings, the device untouched (a check that does not apply to
    the device or the number of nodes is left out)."""
    checks = [check("stack: torch and the device runtime", lambda: _versions(target.device))]
    checks.append(check("stack: devices for the ranks", lambda: _device_count(target)))
    if target.device == "neuron":
        checks.append(check("stack: logical NeuronCores (LNC)", lambda: _lnc(target)))
        checks.append(check(f"stack: {VISIBLE_CORES_ENV}", lambda: _visible_cores(target)))
    checks.append(check("stack: free disk for checkpoints", lambda: _disk(target)))
    checks.append(check("stack: compile cache", lambda: _compile_cache(target)))
    if target.launch.nnodes > 1:
        if target.device != "cpu":
            checks.append(check("stack: EFA", _efa))
        checks.append(check("stack: rendezvous endpoint", lambda: _rendezvous(target.launch)))
        checks.append(check("stack: shared work directory", lambda: _shared(Path(target.work_dir), "--work-dir")))
    return checks


def neuronx_pairs(torch_version: str, neuronx_version: str) -> bool:
    """Whether torch-neuronx ``neuronx_version`` is built for torch ``torch_version``: torch-neuronx
    X.Y.* pairs with torch X.Y (AWS Neuron release notes: torch-neuronx 2.13.x for PyTorch 2.13)."""
    return neuronx_version.split(".")[:2] == torch_version.split("+")[0].split(".")[:2]


def _versions(device: str) -> str:
    import torch
    import torch.distributed as dist

    version = torch.__version__
    if device == "cpu":
        assert dist.is_gloo_available(), f"torch {version} has no gloo backend; install a build of torch with gloo"
        return f"torch {version}, gloo available"
    if device == "cuda":
        assert torch.version.cuda, f"torch {version} is not a CUDA build; install torch for this host's CUDA"
        assert dist.is_nccl_available(), f"torch {version} has no NCCL backend"
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        return f"torch {version} (CUDA {torch.version.cuda}, NCCL {nccl})"
    neuronx = importlib.metadata.version("torch-neuronx")
    assert neuronx_pairs(version, neuronx), (
        f"torch-neuronx {neuronx} is not built for torch {version}; install torch-neuronx "
        f"{'.'.join(version.split('.')[:2])}.* from AWS's Neuron pip repository, or the torch it pairs with"
    )
    return f"torch {version}, torch-neuronx {neuronx}"


def _device_count(target: DoctorTarget) -> str:
    nproc = target.launch.nproc_per_node
    if target.device == "cpu":
        cores = os.cpu_count() or 1
        return f"{nproc} ranks on {cores} CPU cores" + (" (ranks share cores: slower, still correct)" * (nproc > cores))
    if target.device == "cuda":
        import torch

        found = torch.cuda.device_count()  # no CUDA context in this process: the ranks own the devices
        assert found >= nproc, (
            f"launch.nproc_per_node={nproc} but this host has {found} CUDA devices; use at most {found}"
        )
        return f"{found} CUDA devices for {nproc} ranks"
    chips = _neuron_devices()
    hw = get_hardware(target.hardware)
    if not hw.cores_per_chip:
        return f"{len(chips)} Neuron devices for {nproc} ranks ({hw.name} gives no cores per device to count)"
    cores = len(chips) * hw.cores_per_chip // hw.lnc
    assert cores >= nproc, (
        f"launch.nproc_per_node={nproc} but this host's {len(chips)} Neuron devices have {cores} logical cores at "
        f"LNC={hw.lnc}; use at most {cores} ranks"
    )
    return f"{len(chips)} Neuron devices, {cores} logical cores at LNC={hw.lnc}, for {nproc} ranks"


def _lnc(target: DoctorTarget) -> str:
    lnc = lnc_from_env()  # a value other than 1 or 2 is refused here
    hw = get_hardware(target.hardware)
    setting = f"{LNC_ENV}={lnc}" if lnc else f"{LNC_ENV} unset (the runtime's default, {DEFAULT_LNC})"
    if not hw.lnc:
        return f"{setting}; {hw.name} has no logical cores to plan for"
    nproc = target.launch.nproc_per_node
    assert nproc <= hw.ranks_per_node, (
        f"{setting}: a {hw.name} has {hw.ranks_per_node} ranks of {hw.memory_per_rank / GiB:.0f} GiB, but "
        f"launch.nproc_per_node={nproc}; use at most {hw.ranks_per_node} ranks, or a smaller {LNC_ENV}"
    )
    return (
        f"{setting}: {hw.ranks_per_node} ranks of {hw.memory_per_rank / GiB:.0f} GiB per {hw.name}, as the planner "
        f"plans; {nproc} ranks per node"
    )


def _visible_cores(target: DoctorTarget) -> str:
    value = os.environ.get(VISIBLE_CORES_ENV)
    if value is None:
        return "unset: each rank is given the core of its LOCAL_RANK"
    single = value.strip().isdigit()
    assert single and target.launch.nproc_per_node == 1, (
        f"{VISIBLE_CORES_ENV}={value} is inherited by all {target.launch.nproc_per_node} ranks, which would claim the "
        f"same cores; unset it so that each rank is given the core of its LOCAL_RANK"
    )
    return f"{VISIBLE_CORES_ENV}={value}: the one rank runs on that core"


def checkpoint_bytes(shape: ModelShape, *, lora: LoraConfig | None = None, optimizer: str = "adamw") -> int:
    """Bytes of one checkpoint of ``shape``: the trained parameters in fp32 and the optimizer's
    state per trained parameter (AdamW: two fp32 moments; plain SGD: none); under LoRA only the
    adapters and the modules trained in full."""
    from .planning.lora import trainable_parameters

    trained = trainable_parameters(shape, lora) if lora else shape.num_parameters
    return int(trained * 4 * (1 + (2 if optimizer == "adamw" else 0)))


def _existing(path: Path) -> Path:
    """``path`` up to its first ``{flow_run…}`` part, then its nearest existing ancestor."""
    path = Path(str(path).split("{", 1)[0] or ".").expanduser().resolve()
    while not path.exists():
        path = path.parent
    return path


def _disk(target: DoctorTarget) -> str:
    shape = target.shape()
    if shape is None:
        return (
            f"not applicable yet: {target.model_name} is not on this host, so its size is unknown; run "
            "`neuron-flows doctor --config …` once it is fetched"
        )
    one = checkpoint_bytes(shape, lora=target.lora, optimizer=target.optimizer)
    where = _existing(Path(target.output_dir))
    free = shutil.disk_usage(where).free
    what = f"a checkpoint of {shape.name or 'the model'} takes {one / GiB:.2f} GiB"
    assert free >= 2 * one, (
        f"{free / GiB:.1f} GiB free at {where}, but {what} and a save needs room for two; free space there or "
        "point output.dir at a larger volume"
    )
    return f"{free / GiB:.1f} GiB free at {where}; {what} (2× {2 * one / GiB:.2f} GiB)"


def compile_cache_dir(device: str) -> tuple[str | None, str]:
    """(the directory ``device``'s compiler caches graphs in, its variable): the NEFF cache on
    neuron, inductor's (``train.compile`` on cpu and cuda) elsewhere; None when the variable is
    unset (each compiler's default)."""
    name = NEFF_CACHE_ENV if device == "neuron" else INDUCTOR_CACHE_ENV
    return os.environ.get(name), name


def _compile_cache(target: DoctorTarget) -> str:
    where, name = compile_cache_dir(target.device)
    nnodes = target.launch.nnodes
    if where is None:
        assert target.device != "neuron" or nnodes == 1, (
            f"{name} is unset, so each of the {nnodes} nodes compiles every graph itself, each start again; set it "
            "to a directory on the volume every node mounts"
        )
        where = tempfile.gettempdir()  # inductor's default is a folder in it
        default = f"{name} unset: the compiler's default, on this host only"
    else:
        default = name
    path = Path(where).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-") as f:
        f.write(b"x")
        f.flush()
        os.fsync(f.fileno())
    # A cold NEFF cache costs minutes per graph on every node: it must be shared; inductor's, seconds.
    shared = f"; {_shared(path, name)}" if nnodes > 1 and target.device == "neuron" else ""
    return f"{default}: {path} is writable{shared}"


def _mount(path: Path) -> tuple[str, str]:
    """(mount point, file system type) of the mount holding ``path``."""
    best = ("/", "")
    real = str(_existing(path))
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            point = parts[1].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
                best = (point, parts[2])
    return best


def _shared(path: Path, what: str) -> str:
    point, kind = _mount(path)
    assert kind in SHARED_FILESYSTEMS, (
        f"{what} {path} is on {kind or 'a local file system'} ({point}), which the other nodes do not see; put it on "
        f"the volume every node mounts (FSx for Lustre, EFS, NFS)"
    )
    return f"{path} is on {kind} ({point}), which every node mounts"


def _efa() -> str:
    provider = os.environ.get("FI_PROVIDER", "")
    devices = (
        sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
        if Path("/sys/class/infiniband").is_dir()
        else []
    )
    assert devices, "no EFA device (/sys/class/infiniband is empty): request vpc.amazonaws.com/efa interfaces"
    assert provider == "efa", f"FI_PROVIDER={provider or '(unset)'}; set FI_PROVIDER=efa so that collectives use EFA"
    return f"FI_PROVIDER=efa, {len(devices)} devices ({', '.join(devices[:4])}{'…' * (len(devices) > 4)})"


def _rendezvous(launch: LaunchConfig) -> str:
    host, _, port = (launch.rdzv_endpoint or "").rpartition(":")
    assert host and port.isdigit(), f"launch.rdzv_endpoint={launch.rdzv_endpoint!r} is not HOST:PORT"
    try:
        addresses = sorted({a[4][0] for a in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)})
    except OSError as e:
        raise AssertionError(f"{host} does not resolve ({e}); name the first node as every node can reach it") from None
    return f"{launch.rdzv_endpoint} resolves to {', '.join(addresses)}"
