"""HardwareProfile: one device type's compute, memory and link numbers, loaded from a JSON data file."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

PROFILE_DIR = Path(__file__).parent / "profiles"
"""The built-in profiles (public spec sheets), one JSON file per device type."""
LOCAL_PROFILE_NAMES = {"cpu": "cpu-local", "cuda": "cuda-local"}
"""The profile `hybridflow calibrate` measures on this machine, per device type it finds."""
LOCAL_PROFILE_NAME = LOCAL_PROFILE_NAMES["cpu"]

GIB = 1024**3
FIXED_COST_FIELDS = ("decode_step_overhead_s", "inference_call_overhead_s", "update_overhead_s",
                     "fsdp_collective_overhead_s", "controller_call_overhead_s")
"""Per-call host costs that do not scale with the work (what dominates a tiny model's stages); 0 (off) by default."""


def local_profile_dir() -> Path:
    """Where `hybridflow calibrate` writes the measured profile (HYBRIDFLOW_HOME, else ~/.cache/hybridflow)."""
    home = os.environ.get("HYBRIDFLOW_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "hybridflow")
    return Path(home) / "hardware"


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """What the simulators need to know about a device and the links between devices.

    Peak numbers come from spec sheets (GPUs) or measurements (CPU); each ``*_fraction`` is the share
    of the peak that real kernels reach, so the simulators use peak * fraction.
    """

    name: str
    """Profile name (file stem for the built-in ones)."""
    device_memory_gib: float
    """Memory of one device (GiB)."""
    usable_memory_fraction: float
    """Share of that memory models may fill (the rest: runtime context, allocator fragmentation)."""
    peak_flops: float
    """Dense matrix-multiply FLOP/s of one device in compute_dtype."""
    flops_fraction: float
    """Achievable share of peak_flops for transformer training/inference (model FLOPs utilization)."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    memory_bandwidth_fraction: float
    """Achievable share of memory_bandwidth by decode kernels (weights and KV cache streaming)."""
    intra_node_bandwidth: float
    """Collective bandwidth between devices of one node, bytes/s per device and direction."""
    inter_node_bandwidth: float
    """Collective bandwidth between nodes, bytes/s per device and direction."""
    link_bandwidth_fraction: float
    """Achievable share of the link bandwidths by collectives (NCCL/gloo bus bandwidth)."""
    intra_node_latency_s: float
    """Latency of one ring step of a collective inside a node, seconds: a ring all-reduce over g ranks
    pays 2 (g - 1) of them, an all-gather g - 1, a point-to-point send one."""
    inter_node_latency_s: float
    """Latency of one ring step of a collective whose ring crosses nodes, seconds."""
    compute_dtype: str = "bf16"
    """'bf16' (mixed precision: bf16 weights, fp32 master weights and Adam) or 'fp32' (everything fp32)."""
    compute_units_per_node: int = 0
    """CPU profiles: cores shared by the processes of one node (when more of its processes are busy
    at once than it has cores, they divide FLOP/s, memory bandwidth and dispatch speed); 0 for
    devices that do not share."""
    decode_host_seconds_per_sequence: float = 0.0
    """Host seconds per sequence of a replica's batch per decode step that do not overlap the device
    (the rollout engine's scheduling, sampling and bookkeeping run between steps): a replica decoding
    B sequences pays B times this per generated token. 0 where decoding is device-bound."""
    native_decode_bandwidth_fraction: float | None = None
    """Achievable share of memory_bandwidth by the decode of hybridflow's own rollout engine
    (``actor.generation.backend: native``: plain PyTorch ops, static decode replayed as CUDA graphs), where
    it differs from a serving engine's fused kernels (memory_bandwidth_fraction, which the vllm backend
    uses). None: the same as memory_bandwidth_fraction (not measured on this device type)."""
    layer_overhead_s: float = 0.0
    """Host seconds per decoder layer per forward pass that do not overlap with compute (a backward
    counts twice): eager op dispatch on CPU, measured by calibrate; 0 on GPUs, whose kernel launches run
    ahead asynchronously (where the host cannot keep up in decoding: decode_dispatch_seconds_per_layer)."""
    decode_dispatch_seconds_per_layer: float = 0.0
    """Host seconds to launch one decoder layer's kernels in a decode step run eagerly (verl's rollout runs
    vLLM with ``enforce_eager: True``; hybridflow's native engine replays CUDA graphs only at tg = 1).
    Launches run ahead of the device, so a step takes max(device time, layers per stage x this): a floor
    that binds when a replica's batch is small. 0: no floor (not measured on any device type yet)."""
    decode_step_overhead_s: float = 0.0
    """Host seconds of one generation step (prefill or decode) that depend neither on the batch nor on the
    depth: the embedding lookup, the output head's call, sampling and the decode loop's bookkeeping. A floor of
    every step, serial with compute. CPU: measured by calibrate on the native engine at batch 1 (what its step
    takes beyond the layers' ``layer_overhead_s`` and the roofline); 0 on GPUs (not measured there)."""
    inference_call_overhead_s: float = 0.0
    """Host seconds of one inference call of a training engine (log-probs, values, scores) beyond its layers'
    work: packing the batch into micro-batches, the head's outputs, unpacking. CPU: measured by calibrate
    (the intercept of a forward's seconds against its rows); 0 on GPUs (not measured there)."""
    update_overhead_s: float = 0.0
    """Host seconds of one optimizer update beyond its forward and backward: packing, gradient clipping,
    the optimizer and LR steps, zeroing the gradients. CPU: measured by calibrate (the intercept of a train
    step's seconds against its rows); 0 on GPUs (not measured there)."""
    fsdp_collective_overhead_s: float = 0.0
    """Host seconds FSDP2 adds to each of its collectives (one all-gather per unit and pass, one
    reduce-scatter per unit and update) beyond the ring's latency and bytes: the hooks and the copies in and
    out of the flat buffers, serial with compute. Paid with d >= 2 only. CPU: measured by calibrate (a 2-rank
    minus a 1-rank FSDP step, per collective); 0 on GPUs (not measured there)."""
    controller_call_overhead_s: float = 0.0
    """Seconds of one call of the single controller on a worker group that does no work (Ray dispatch,
    argument and result serialization, the collect): each role's call in each stage pays it, and each call of
    a split's weight sync and generation. Measured by calibrate on CPU (a 2-rank group); 0 in the built-in GPU
    profiles (where stages take seconds, milliseconds do not matter)."""
    cpu_bf16_peak_flops: float | None = None
    """CPU profiles of a host whose cores multiply bf16 in hardware (AVX512-BF16 or AMX): one thread's bf16 matmul
    FLOP/s. There ``engine.dtype: auto`` computes models at least ``cpu_bf16_min_hidden`` wide in bf16
    (``hybridflow.device.default_dtype``), so the simulators cost those models at this rate with bf16 elements
    (``for_model``). None: every model computes in compute_dtype at peak_flops."""
    cpu_bf16_min_hidden: int = 0
    """The narrowest model that computes in bf16 where ``cpu_bf16_peak_flops`` is set (calibrate writes
    ``hybridflow.device.CPU_BF16_MIN_HIDDEN``)."""
    source: str = ""
    """Where the numbers come from (spec sheet, calibration command and date)."""

    def __post_init__(self) -> None:
        positive = ("device_memory_gib", "peak_flops", "memory_bandwidth", "intra_node_bandwidth",
                    "inter_node_bandwidth")
        for field_name in positive:
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"HardwareProfile.{field_name} must be a positive number, got {value!r}")
        for field_name in ("usable_memory_fraction", "flops_fraction", "memory_bandwidth_fraction",
                           "link_bandwidth_fraction"):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"HardwareProfile.{field_name} must be in (0, 1], got {value!r}")
        for field_name in ("intra_node_latency_s", "inter_node_latency_s", "layer_overhead_s",
                           "decode_host_seconds_per_sequence", "decode_dispatch_seconds_per_layer",
                           *FIXED_COST_FIELDS):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"HardwareProfile.{field_name} must be >= 0 seconds, got {value!r}")
        fraction = self.native_decode_bandwidth_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ValueError(f"HardwareProfile.native_decode_bandwidth_fraction must be in (0, 1] or null "
                             f"(same as memory_bandwidth_fraction), got {fraction!r}")
        bf16_flops = self.cpu_bf16_peak_flops
        if bf16_flops is not None and (isinstance(bf16_flops, bool) or not isinstance(bf16_flops, (int, float))
                                       or bf16_flops <= 0):
            raise ValueError(f"HardwareProfile.cpu_bf16_peak_flops must be a positive number or null (no native "
                             f"bf16), got {bf16_flops!r}")
        if (not isinstance(self.cpu_bf16_min_hidden, int) or isinstance(self.cpu_bf16_min_hidden, bool)
                or self.cpu_bf16_min_hidden < 0):
            raise ValueError(f"HardwareProfile.cpu_bf16_min_hidden must be an integer >= 0, "
                             f"got {self.cpu_bf16_min_hidden!r}")
        if self.compute_dtype not in ("bf16", "fp32"):
            raise ValueError(f"HardwareProfile.compute_dtype must be 'bf16' or 'fp32', got {self.compute_dtype!r}")
        if not isinstance(self.compute_units_per_node, int) or self.compute_units_per_node < 0:
            raise ValueError(f"HardwareProfile.compute_units_per_node must be an integer >= 0, "
                             f"got {self.compute_units_per_node!r}")

    def cpu_bf16_for(self, hidden_size: int) -> bool:
        """Whether a model ``hidden_size`` wide computes in bf16 on this bf16-capable CPU (``cpu_bf16_peak_flops``)."""
        return self.cpu_bf16_peak_flops is not None and hidden_size >= self.cpu_bf16_min_hidden

    def for_model(self, hidden_size: int) -> "HardwareProfile":
        """The profile as a model ``hidden_size`` wide runs on it: a bf16-capable CPU's bf16 rate and elements
        for models that compute in bf16 there (``cpu_bf16_for``), else this profile unchanged."""
        if not self.cpu_bf16_for(hidden_size):
            return self
        return replace(self, peak_flops=self.cpu_bf16_peak_flops, compute_dtype="bf16")

    @property
    def usable_memory_bytes(self) -> float:
        return self.device_memory_gib * GIB * self.usable_memory_fraction

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight or activation element in compute_dtype."""
        return 2 if self.compute_dtype == "bf16" else 4

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "profile") -> "HardwareProfile":
        """A profile from a JSON object; every error names ``source`` (the file) and the fields."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: a hardware profile must be a JSON object of fields, "
                             f"got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown hardware profile fields {unknown}; allowed: {sorted(known)}")
        required = sorted(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"{source}: hardware profile lacks the required fields {missing}; "
                             f"required: {required}")
        try:
            return cls(**data)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None


def builtin_profile_names() -> list[str]:
    return sorted(path.stem for path in PROFILE_DIR.glob("*.json"))


def load_hardware(name_or_path: str | HardwareProfile) -> HardwareProfile:
    """A built-in profile by name (``a100-80g``...), ``cpu-local`` (after calibration) or a JSON file."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    key = str(name_or_path).lower()
    if key in LOCAL_PROFILE_NAMES.values():
        path = local_profile_dir() / f"{key}.json"
        if not path.is_file():
            device = "a CUDA machine" if key == LOCAL_PROFILE_NAMES["cuda"] else "a machine without a GPU"
            raise ValueError(f"hardware {key!r} has not been measured on this machine yet "
                             f"(no {path}); run `hybridflow calibrate` on {device} first")
    elif (PROFILE_DIR / f"{key}.json").is_file():
        path = PROFILE_DIR / f"{key}.json"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"unknown hardware {name_or_path!r}; known: "
                             f"{', '.join(builtin_profile_names() + list(LOCAL_PROFILE_NAMES.values()))}, "
                             f"or a profile JSON file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"hardware profile {path} is not valid JSON: {error.msg} at line {error.lineno} "
                         f"column {error.colno}") from None
    except OSError as error:
        raise ValueError(f"hardware profile {path} cannot be read: {error.strerror}") from None
    return HardwareProfile.from_dict(data, source=str(path))
