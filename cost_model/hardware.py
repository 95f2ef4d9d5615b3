"""Hardware profiles: how fast a device computes and how fast each mesh axis communicates.

Every profile answers two questions for the cost model: the time of an operator given its FLOPs
and the bytes it moves (:meth:`Profile.compute_s`), and the latency ``alpha`` and seconds per
byte ``beta`` of the link under a mesh axis (:meth:`Profile.link`). :class:`Profile` lists all
that the cost model and planner read; :class:`HardwareProfile` (datasheet figures of a real
device) and :class:`SyntheticProfile` (round numbers for reasoning by hand) provide it. The
factors that ``autopar calibrate`` measures and fits on the host that plans are kept apart from
those figures, in :class:`Fitted`: every one of them defaults to the value that changes nothing,
so a datasheet profile leaves them out.
"""

import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from autopar.core.mesh import Link, Mesh


@dataclass(frozen=True, slots=True)
class Host:
    """What offloading to host memory costs: the device-host copy ``link``, and the seconds the
    host takes to step optimizer state, from the bytes the step reads and writes (``None``
    when unknown: optimizer state then stays on the device)."""

    link: Link
    update_s: Callable[[float], float | None]
    capacity_bytes: float = math.inf
    """Host memory one device may fill: its host's memory shared by the host's devices."""

    def copy_s(self, nbytes: float) -> float:
        return self.link.latency_s + nbytes * self.link.s_per_byte

    def optimizer_s(self, grad_bytes: float, state_bytes: float) -> float | None:
        """Seconds per step of stepping one parameter's optimizer state on the host: its
        gradient copied out, the new piece copied back, and the update, which reads the piece,
        its gradient and the state and writes the piece and the state (``None`` when the host's
        update time is unknown)."""
        update = self.update_s(3 * grad_bytes + 2 * state_bytes)
        return None if update is None else 2 * self.copy_s(grad_bytes) + update


@dataclass(frozen=True, slots=True, kw_only=True)
class Fitted:
    """The factors that ``autopar calibrate`` (:mod:`autopar.calibrate`) measures and fits on
    the host that plans, on top of a profile's figures. Each defaults to the value that changes
    nothing, which is what a profile from a datasheet has."""

    op_overhead_s: float = 0.0
    """Fixed time of running one op, whatever its size (dispatch and launch); it matters for
    eager execution of small graphs, as on a CPU host."""
    timed_ops: bool = False
    """Whether the profile describes the host that plans, so that the cost model times each
    op there (:mod:`autopar.cost_model.op_timing`) instead of using the roofline; a profile
    written by ``autopar calibrate`` does."""
    node_overhead_s: float = 0.0
    """What one node of a per-rank program costs beyond its op timed alone (the op's dispatch
    is colder in a program of many ops than in a loop of one); added to each timed op."""
    step_overhead_s: float = 0.0
    """Time per training step of the work around the per-rank program (autograd running the
    program's forward and backward), besides ``param_overhead_s`` per parameter."""
    param_overhead_s: float = 0.0
    """Time per step and parameter of that work (autograd accumulating each gradient)."""
    contention: float = 1.0
    """How many times slower an op runs while every rank of the host computes than while one
    does (ranks sharing cores or memory bandwidth); multiplies the timed ops, which are timed
    on one rank."""
    step_scale: float = 1.0
    """How many times longer a training step runs its ops and collectives than they take
    measured alone (ranks drifting apart between collectives, a rank woken from
    its wait, caches shared with the other ranks); ``autopar calibrate`` measures it on a
    calibration model's steps. Multiplies every op and collective the cost model prices, not
    the node and step overheads (measured as a program and a step run them) nor copies to the
    host."""
    collective_scale: float = 1.0
    """How many times longer a collective runs inside a training step than as calibrated (after
    a few matmuls on every rank), relative to ``step_scale``: above 1 where a step stretches its
    collectives more than its ops (ranks reaching them further apart), below 1 where it
    stretches its ops more. ``autopar calibrate`` fits it with ``step_scale`` on the
    calibration model's layouts, which spend different shares of their step in collectives.
    Multiplies every collective, with the local ops around it, on top of ``step_scale``."""


@runtime_checkable
class Profile(Protocol):
    """What the cost model and planner read from a hardware profile; :class:`HardwareProfile`
    and :class:`SyntheticProfile` provide it, and so may any other class."""

    @property
    def name(self) -> str:
        """Short name, shown in plans and messages."""
        ...

    @property
    def memory_bytes(self) -> int:
        """Device memory; the planner warns when a plan needs more."""
        ...

    @property
    def host_link(self) -> Link | None:
        """The device-to-host copy link for offloading; ``None``: nothing is offloaded."""
        ...

    @property
    def fitted(self) -> Fitted:
        """The factors fitted on the host that plans (neutral for a datasheet profile)."""
        ...

    def compute_s(self, flops: float, bytes_moved: float, fmt: str | None = None) -> float:
        """Seconds of an op doing ``flops`` and moving ``bytes_moved``, its multiply-adds in the
        format ``fmt`` (``None``: not a matrix product); with the fitted per-op overhead."""
        ...

    def link(self, mesh: Mesh, axis: int) -> Link:
        """The α-β link under axis ``axis`` of ``mesh``."""
        ...

    def host_update_s(self, bytes_moved: float) -> float | None:
        """Seconds the host takes to read and write ``bytes_moved`` bytes of optimizer state
        (``None`` when unknown)."""
        ...

    def host_bytes_per_device(self) -> float:
        """Host memory each device may fill with what it offloads (infinite: no limit)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    """A real device: roofline compute and two link tiers (inside a host, across hosts).

    Mesh axes are assigned to links from the innermost (last) axis outwards: while the product
    of the inner axes' sizes fits in ``devices_per_host`` the axis runs over the intra-host link.
    """

    name: str
    """Short name used by ``hardware="..."``."""
    flops_per_s: float
    """Peak throughput of ops that :attr:`matrix_flops_per_s` does not list."""
    memory_bytes_per_s: float
    """Peak device-memory bandwidth."""
    efficiency: float
    """Fraction of the peaks that real kernels reach."""
    memory_bytes: int
    """Device memory."""
    devices_per_host: int
    """Devices joined by the intra-host link."""
    intra_host: Link
    inter_host: Link
    host_link: Link | None = None
    """The copy link between a device and its host's memory (PCIe), for offloading activations
    and optimizer state; ``None`` where the device computes in host memory (a CPU), so that
    offloading would save nothing."""
    host_memory_bytes_per_s: float = 0.0
    """Host-memory bandwidth per device, which an optimizer step run on the host is bound by."""
    host_memory_bytes: int = 0
    """Memory of one host, shared by its ``devices_per_host`` devices for what they offload
    (0: no limit)."""
    matrix_flops_per_s: tuple[tuple[str, float], ...] = ()
    """Peak dense throughput of matrix products (matmuls, convolutions, attention) by the
    format their multiply-adds run in (:func:`autopar.cost_model.compute.math_format`):
    ``"float64"``, ``"float32"``, ``"tf32"`` (float32 operands on tensor cores, where torch
    allows it), ``"bfloat16"``, ``"float16"``; a format not listed runs at ``flops_per_s``.
    On a GPU these differ by 15x: an H100 multiplies float32 at 67 TFLOP/s and bfloat16 at 989."""
    fitted: Fitted = Fitted()
    """The factors ``autopar calibrate`` fits on the host that plans (none for a datasheet)."""

    def compute_s(self, flops: float, bytes_moved: float, fmt: str | None = None) -> float:
        """Roofline time of an op doing ``flops`` and moving ``bytes_moved``, its multiply-adds
        in the format ``fmt`` (``None``: not a matrix product), plus the fitted per-op overhead."""
        rate = dict(self.matrix_flops_per_s).get(fmt, self.flops_per_s) if fmt else self.flops_per_s
        roofline = max(flops / rate, bytes_moved / self.memory_bytes_per_s) / self.efficiency
        return self.fitted.op_overhead_s + roofline

    def host_update_s(self, bytes_moved: float) -> float | None:
        """Seconds the host takes to read and write ``bytes_moved`` bytes of optimizer state
        (``None`` when the profile does not know its host's bandwidth)."""
        return bytes_moved / self.host_memory_bytes_per_s if self.host_memory_bytes_per_s > 0 else None

    def host_bytes_per_device(self) -> float:
        """Host memory each device may fill with what it offloads (infinite: no limit)."""
        return self.host_memory_bytes / self.devices_per_host if self.host_memory_bytes else math.inf

    def link(self, mesh: Mesh, axis: int) -> Link:
        inner = 1
        for size in mesh.shape[axis:]:
            inner *= size
        return self.intra_host if inner <= self.devices_per_host else self.inter_host


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticProfile:
    """A profile for reasoning by hand and for tests.

    An operator costs ``flops * s_per_flop + bytes_moved * s_per_byte_memory``, plus the fitted
    per-op overhead (none unless given); operators with no FLOP formula count one FLOP per
    output element. Communication on mesh axis ``i`` is α-β
    with ``latency_s`` and ``s_per_byte[i]`` (one number applies to every axis).
    """

    name: str = "synthetic"
    s_per_flop: float = 1e-12
    """Seconds per FLOP."""
    s_per_byte_memory: float = 0.0
    """Seconds per byte read or written by an operator."""
    latency_s: float = 1e-6
    """α of every axis."""
    s_per_byte: float | tuple[float, ...] = 1e-12
    """β of every axis, or one per axis."""
    memory_bytes: int = 80 * 2**30
    """Device memory."""
    host_link: Link | None = None
    """The device-to-host copy link; ``None``: nothing is offloaded."""
    host_s_per_byte_memory: float = 0.0
    """Seconds per byte an optimizer step on the host reads or writes."""
    host_memory_bytes: int = 0
    """Host memory each device may fill with what it offloads (0: no limit)."""
    fitted: Fitted = Fitted()
    """Factors on top of these figures, as :class:`HardwareProfile` takes them (none by default)."""

    def compute_s(self, flops: float, bytes_moved: float, fmt: str | None = None) -> float:
        return self.fitted.op_overhead_s + flops * self.s_per_flop + bytes_moved * self.s_per_byte_memory

    def host_update_s(self, bytes_moved: float) -> float | None:
        return bytes_moved * self.host_s_per_byte_memory

    def host_bytes_per_device(self) -> float:
        """Host memory each device may fill with what it offloads (infinite: no limit)."""
        return self.host_memory_bytes or math.inf

    def link(self, mesh: Mesh, axis: int) -> Link:
        beta = self.s_per_byte
        if isinstance(beta, tuple):
            if len(beta) != mesh.ndim:
                raise ValueError(f"SyntheticProfile.s_per_byte has {len(beta)} entries but {mesh} has {mesh.ndim} axes")
            beta = beta[axis]
        return Link(self.latency_s, beta)


# Figures: NVIDIA H100 SXM5 datasheet (dense: 989 TFLOP/s BF16 and FP16, 495 TF32 and 67 FP64 on
# tensor cores, 67 FP32 on CUDA cores; 3.35 TB/s HBM3, NVLink 4 at 450 GB/s per direction, 80 GB),
# ConnectX-7 NDR InfiniBand (400 Gb/s = 50 GB/s per GPU), PCIe Gen5 x16 to the host (64 GB/s per
# direction, about 50 GB/s for pinned copies) and the DGX H100's two Xeon 8480C sockets (8
# channels of DDR5-4800 each, 614 GB/s for 8 GPUs, 2 TB of memory).
HOPPER_MATRIX_FLOPS = (
    ("bfloat16", 989e12),
    ("float16", 989e12),
    ("tf32", 495e12),
    ("float32", 67e12),
    ("float64", 67e12),
)
H100 = HardwareProfile(
    name="h100",
    flops_per_s=989e12,
    memory_bytes_per_s=3.35e12,
    efficiency=0.6,
    memory_bytes=80 * 10**9,
    devices_per_host=8,
    intra_host=Link(latency_s=5e-6, s_per_byte=1 / 450e9),
    inter_host=Link(latency_s=10e-6, s_per_byte=1 / 50e9),
    host_link=Link(latency_s=10e-6, s_per_byte=1 / 50e9),
    host_memory_bytes_per_s=614e9 / 8,
    host_memory_bytes=2 * 10**12,
    matrix_flops_per_s=HOPPER_MATRIX_FLOPS,
)
# NVIDIA H200 SXM datasheet: the H100's compute (above), 4.8 TB/s of HBM3e, 141 GB; the same
# NVLink 4, network, PCIe and host as the H100 in an HGX H200.
H200 = dataclasses.replace(H100, name="h200", memory_bytes_per_s=4.8e12, memory_bytes=141 * 10**9)
# NVIDIA A100 SXM4 80 GB datasheet (dense: 312 TFLOP/s BF16 and FP16, 156 TF32 and 19.5 FP64 on
# tensor cores, 19.5 FP32 on CUDA cores; 2.04 TB/s HBM2e, NVLink 3 at 300 GB/s per direction),
# HDR InfiniBand (200 Gb/s = 25 GB/s per GPU), PCIe Gen4 x16 (32 GB/s per direction, about 25
# GB/s pinned) and the DGX A100's two EPYC 7742 sockets (8 channels of DDR4-3200 each, 410 GB/s
# for 8 GPUs, 1 TB of memory).
A100 = HardwareProfile(
    name="a100",
    flops_per_s=312e12,
    memory_bytes_per_s=2.04e12,
    efficiency=0.6,
    memory_bytes=80 * 10**9,
    devices_per_host=8,
    intra_host=Link(latency_s=5e-6, s_per_byte=1 / 300e9),
    inter_host=Link(latency_s=10e-6, s_per_byte=1 / 25e9),
    host_link=Link(latency_s=10e-6, s_per_byte=1 / 25e9),
    host_memory_bytes_per_s=410e9 / 8,
    host_memory_bytes=10**12,
    matrix_flops_per_s=(
        ("bfloat16", 312e12),
        ("float16", 312e12),
        ("tf32", 156e12),
        ("float32", 19.5e12),
        ("float64", 19.5e12),
    ),
)
# A small CPU host running gloo over loopback; order-of-magnitude figures for a 2-core VM.
CPU = HardwareProfile(
    name="cpu",
    flops_per_s=50e9,
    memory_bytes_per_s=10e9,
    efficiency=0.5,
    memory_bytes=16 * 2**30,
    devices_per_host=64,
    intra_host=Link(latency_s=50e-6, s_per_byte=1 / 1e9),
    inter_host=Link(latency_s=100e-6, s_per_byte=1 / 1e9),
)

PROFILES = {p.name: p for p in (H100, H200, A100, CPU)}


def resolve_profile(hardware: "str | os.PathLike | Profile") -> Profile:
    """Return the profile named by ``hardware`` (``"h100"``, ``"h200"``, ``"a100"``, ``"cpu"``), the one saved
    in the JSON file it names (``autopar calibrate`` writes one), or ``hardware`` itself when it
    is already a profile."""
    if isinstance(hardware, Profile):
        return hardware
    if isinstance(hardware, os.PathLike) or (isinstance(hardware, str) and hardware.endswith(".json")):
        return load_profile(hardware)
    if isinstance(hardware, str):
        try:
            return PROFILES[hardware.lower()]
        except KeyError:
            raise ValueError(
                f"hardware={hardware!r} is not a known profile; use one of {sorted(PROFILES)}, "
                "a profile file written by `autopar calibrate`, or a HardwareProfile / SyntheticProfile"
            ) from None
    raise TypeError(f"hardware must be a profile name or a profile object, got {type(hardware).__name__}")


class InsideStages:
    """``profile`` as seen from the mesh inside pipeline stages (the ``whole`` mesh without its
    pipeline axis): each axis keeps the link it has on the whole mesh (a profile assigns links
    by an axis's position among all of them), the rest is ``profile``'s."""

    def __init__(self, profile: "Profile", whole: Mesh):
        self._profile, self._whole = profile, whole

    def link(self, mesh: Mesh, axis: int) -> Link:
        name = mesh.axis_names[axis]
        names = self._whole.axis_names
        return self._profile.link(self._whole, names.index(name) if name in names else self._whole.ndim - 1)

    def __getattr__(self, name: str):
        return getattr(self._profile, name)


def mesh_links(hardware: "Profile", mesh: Mesh) -> tuple[Link, ...]:
    """The α-β link of each axis of ``mesh``, with the cost of the local ops around its
    collectives on this device: an op's fixed time (and a program node's, for a profile that
    times ops), and the time per byte of a copy, both under the ranks' contention; every time
    scaled by the profile's ``step_scale`` and ``collective_scale``."""
    fitted = hardware.fitted
    fixed = hardware.compute_s(0, 0)
    op_s = (fixed + fitted.node_overhead_s) * fitted.contention
    per_byte = (hardware.compute_s(0, 2 * 2**20) - fixed) / 2**20 * fitted.contention  # each byte read and written
    scale = fitted.step_scale * fitted.collective_scale
    return tuple(
        dataclasses.replace(hardware.link(mesh, axis), local_op_s=op_s, local_s_per_byte=per_byte).scaled(scale)
        for axis in range(mesh.ndim)
    )


PROFILE_FORMAT_VERSION = 2
"""Version of the files :func:`save_profile` writes: 2 nests the fitted factors under
``"fitted"``; version 1 (still read) kept them among the figures."""
_FITTED_FIELDS = tuple(f.name for f in dataclasses.fields(Fitted))


def save_profile(profile: HardwareProfile, path: "str | os.PathLike", **measured) -> None:
    """Write ``profile`` as JSON (with any raw ``measured`` figures, for the record)."""
    data = {
        "format": "autopar-hardware-profile",
        "version": PROFILE_FORMAT_VERSION,
        "profile": asdict(profile),
        "measured": measured,
    }
    Path(path).write_text(json.dumps(data, indent=1))


def load_profile(path: "str | os.PathLike") -> HardwareProfile:
    """Read a profile written by :func:`save_profile`, in the current version or version 1."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(
            f"hardware={str(path)!r}: no such profile file; `autopar calibrate --out {path}` writes one"
        ) from None
    version = data.get("version")
    if data.get("format") != "autopar-hardware-profile" or version not in (1, PROFILE_FORMAT_VERSION):
        raise ValueError(
            f"{path} is not an autopar hardware profile (version 1 or {PROFILE_FORMAT_VERSION}); "
            "write one with `autopar calibrate`"
        )
    fields = dict(data["profile"])
    if version == 1:
        fitted = {name: fields.pop(name) for name in _FITTED_FIELDS if name in fields}
    else:
        fitted = fields.pop("fitted", {})
    fields["matrix_flops_per_s"] = tuple(tuple(rate) for rate in fields.get("matrix_flops_per_s", ()))
    for tier in ("intra_host", "inter_host", "host_link"):
        if fields.get(tier) is not None:
            fields[tier] = Link.from_dict(fields[tier])
    return HardwareProfile(**fields, fitted=Fitted(**fitted))
