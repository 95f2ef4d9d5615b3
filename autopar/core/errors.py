"""Errors that autopar raises when it cannot plan, rewrite or run a model.

User mistakes found at the API boundary (a wrong argument type, a mesh that does not match the
world size) raise :class:`ValueError` or :class:`TypeError`. Failures inside the compiler raise a
subclass of :class:`AutoparError`; each message names what failed and ends with what to change.
"""


class AutoparError(RuntimeError):
    """Base class of the compiler's errors."""


class CaptureError(AutoparError):
    """The model could not be traced into a joint forward+backward graph."""


class UnsupportedOpError(AutoparError):
    """The graph holds operators that no sharding rule covers."""


class InfeasiblePlanError(AutoparError):
    """No placement of the graph satisfies the constraints (pins, divisibility)."""


class SolverTimeoutError(InfeasiblePlanError):
    """The search found no plan within its time limit (which says nothing of whether one exists)."""

    def __init__(self, message: str, *, solve_s: float = 0.0, num_variables: int = 0, num_constraints: int = 0):
        super().__init__(message)
        self.solve_s, self.num_variables, self.num_constraints = solve_s, num_variables, num_constraints


class StalePlanError(AutoparError):
    """A plan was made for another model, input shape or mesh."""


class RewriteError(AutoparError):
    """The per-rank graph could not be produced from a plan."""


class InputError(AutoparError, ValueError):
    """A call's inputs do not fit the compiled module: not a tensor, another dtype, device or
    number of dims than planned, or a size that the plan's splits do not divide."""


class CollectiveError(AutoparError):
    """A collective of the per-rank program failed because another rank did not join it: it
    stalled past ``autopar.compile``'s ``timeout``, or it died."""
