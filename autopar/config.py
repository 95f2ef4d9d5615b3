"""The planning options of :func:`autopar.plan` and :func:`autopar.compile`, validated once into
one :class:`PlanConfig` that planning reads."""

import dataclasses
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from autopar.core.mesh import Mesh
from autopar.core.placement import Placement, Placements, parse_placements
from autopar.core.precision import MixedPrecision
from autopar.cost_model.hardware import Profile, resolve_profile
from autopar.passes.analysis.liveness import ADAM_SLOTS
from autopar.passes.propagation.buckets import BUCKET_BYTES
from autopar.passes.solve.remat import RECOMPUTE_OPTIONS
from autopar.passes.solve.stage_memory import StageMemory

Pins = Mapping[str, "str | Sequence[str | Placement]"]


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_memory(value: "int | float | str | None") -> int | None:
    """Bytes from ``40_000_000_000``, ``"40GB"`` (powers of 10) or ``"512MiB"`` (powers of 2)."""
    if value is None:
        return None
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*", value.upper())
        if not match:
            raise ValueError(f"memory_budget={value!r} is not a size; write bytes or a size like '40GB' or '512MiB'")
        value = float(match.group(1)) * _UNITS[match.group(2)]
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes or a size like '40GB', got {value!r}")
    return int(value)


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_OPTIONS:
        raise ValueError(
            f"recompute={recompute!r} is not one of {', '.join(map(repr, RECOMPUTE_OPTIONS))}: "
            "'auto' recomputes what the memory budget needs, 'none' keeps every activation, "
            "'layers' recomputes every layer of a stack from its input"
        )


def check_gap(solver_gap: float) -> None:
    if not isinstance(solver_gap, (int, float)) or not 0 <= solver_gap < 1:
        raise ValueError(
            f"solver_gap={solver_gap!r} is not a fraction in [0, 1): it is how far from the fastest plan "
            "the solver may stop, e.g. 0.01 for 1%"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How to plan: the options of :func:`autopar.plan` (which documents each), checked when
    made, with the hardware profile resolved and the memory budget in bytes."""

    hardware: "str | Profile" = "h100"
    pins: Pins | None = None
    memory_budget: "int | float | str | None" = None
    fallback: bool = True
    solver_time_limit_s: float = 120.0
    solver_gap: float = 1e-3
    share_layers: bool | None = None
    recompute: str = "auto"
    mixed_precision: MixedPrecision | None = None
    bucket_bytes: int = BUCKET_BYTES
    """Capacity of a gradient bucket (:mod:`autopar.passes.propagation.buckets`)."""
    optimizer_slots: int = ADAM_SLOTS
    gradient_share: float = 1.0
    """The share of its gradients' collectives one step of the planned graph pays
    (:attr:`~autopar.cost_model.estimate.CostModel.gradient_share`): less than 1 for one
    micro-batch of a pipelined step (:func:`~autopar.stage_search.plan_stages`)."""
    bucket_groups: Mapping[str, int] | None = None
    """Parameter name → pipeline stage: gradients of different stages never share a bucket."""
    stage_memory: StageMemory | None = None
    """For one micro-batch of a plan in pipeline stages: hold each position of the pipeline
    axis, not one device, to the memory budget (:mod:`autopar.passes.solve.stage_memory`)."""
    profile: Profile = dataclasses.field(init=False, repr=False)
    budget_bytes: int | None = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", resolve_profile(self.hardware))
        object.__setattr__(self, "budget_bytes", parse_memory(self.memory_budget))
        if self.pins is not None:
            if not isinstance(self.pins, Mapping):
                raise TypeError(f"pins must map parameter or input names to placements, got {type(self.pins).__name__}")
            object.__setattr__(self, "pins", MappingProxyType(dict(self.pins)))
        check_recompute(self.recompute)
        slots = self.optimizer_slots
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 0:
            raise ValueError(
                f"optimizer_slots={slots!r}: give the tensors of a parameter's size the optimizer keeps "
                "per parameter: 2 for Adam and AdamW, 1 for SGD with momentum, 0 for SGD without"
            )
        check_gap(self.solver_gap)
        if not isinstance(self.solver_time_limit_s, (int, float)) or not self.solver_time_limit_s > 0:
            raise ValueError(f"solver_time_limit_s={self.solver_time_limit_s!r}: give the seconds the solver may take")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecision):
            raise TypeError(
                f"mixed_precision must be an autopar.MixedPrecision, got {type(self.mixed_precision).__name__}"
            )

    @classmethod
    def of(cls, options: Mapping[str, object]) -> "PlanConfig":
        """The options among ``options`` (the keyword arguments of :func:`autopar.plan` or
        :func:`autopar.compile`) that planning reads; the others are left to their caller."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in options.items() if k in names})

    @property
    def param_dtype(self):
        """The dtype parameters and inputs are computed in, or ``None`` for their own."""
        return self.mixed_precision.param_dtype if self.mixed_precision is not None else None

    def pins_for(self, mesh: Mesh) -> dict[str, Placements]:
        """The pins as placements on ``mesh``, one per axis (an error names a pin that has not)."""
        return {name: parse_placements(value, mesh.ndim) for name, value in (self.pins or {}).items()}

    def with_pins(self, extra: Mapping[str, "Placements | str"]) -> "PlanConfig":
        """These options with ``extra`` pinned beside the user's pins."""
        return dataclasses.replace(self, pins={**(self.pins or {}), **extra})
