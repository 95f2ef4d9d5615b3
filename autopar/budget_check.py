"""A plan's program held to the memory budget by its liveness, with one bounded correction.

The solver counts memory by its rows (:mod:`autopar.passes.solve.memory_program`); the program
the plan lowers to is measured by its liveness (:mod:`autopar.passes.lower.liveness`). Where the
two disagree, for the reason :func:`within_budget` gives, the plan is solved once more (twice
when the first ask has no plan), never more."""

import logging
import time

from autopar.core.errors import InfeasiblePlanError, SolverTimeoutError
from autopar.core.explain import format_bytes
from autopar.core.mesh import Mesh
from autopar.passes.analysis.liveness import Liveness

log = logging.getLogger("autopar")


LIVENESS_MARGIN = 2.5
"""How many times what a plan's program holds beyond the solver's count the correction of
:func:`within_budget` leaves room for below the budget. Asked for less, the solver gathers,
recomputes and offloads more, and the gap can widen: for the 4-rank GPT of the offload run
(``tests/runtime/test_memory_budget.py``) it was 13% of the budget, then 21-27% in plans asked
for 0.69-0.81 of it (2.1 times at most; the GPT-2 XL shape on 2x2 under 60% of its peak, 1.7
times); at twice, the plan was still 1% over."""


class OverByLiveness(InfeasiblePlanError):
    """The searched plans' programs hold more than the budget, after the one correction."""


class NoPlanUnderBudget(Exception):
    """The solver finds no plan under the budget at all."""


def within_budget(attempt, budget: int | None, mesh: Mesh):
    """``attempt(solver_budget) -> (plan, liveness, stage times, solution)`` under ``budget``, the
    plan's program checked by its liveness peak, with one correction at most.

    The solver's count of memory at the moments of the step and the program's liveness disagree
    where the program holds together what the solver counts apart. Mostly the parameters'
    all-gathers, which the program runs in one bucket per layer and phase
    (:func:`~autopar.passes.propagation.buckets.parameter_gathers`): a layer's gathered parameters
    are all alive from the read of its first one, beside the packed copy until they are unpacked,
    where the solver counts each only while the op that reads it runs. The buckets are made from
    the plan the solver returns, so its rows cannot count them: plans that gather parameters again
    for the backward's recomputation are those this puts over a budget. A recomputing or offloading
    backward also holds a little more than the solver counts where nothing is gathered.

    A plan whose program is over the budget is solved once more, the solver asked for the budget
    less ``LIVENESS_MARGIN`` times what the program held beyond its count (or beyond the budget,
    where its count is over it), or, when no plan fits that ask, less once what it held beyond.
    When that plan's program is over the budget too, or the solver finds no plan under the lower
    ask, :class:`OverByLiveness` says what the program holds, and the standard layouts are tried;
    a :class:`SolverTimeoutError` goes up as it is, for the standard layouts to answer. The stage
    times returned add up every solve's."""
    if budget is None:
        return attempt(None)
    try:
        plan, live, times, solution = attempt(float(budget))
    except SolverTimeoutError:
        raise
    except InfeasiblePlanError as exc:
        raise NoPlanUnderBudget() from exc
    if live.peak_bytes <= budget:
        return plan, live, times, solution
    unseen = live.peak_bytes - min(plan.memory.solver_bytes, budget)
    log.info(
        "the program holds %s at its peak, %s over the budget and %s beyond the solver's count: solving again "
        "for %s less than the budget",
        format_bytes(live.peak_bytes),
        format_bytes(live.peak_bytes - budget),
        format_bytes(unseen),
        format_bytes(LIVENESS_MARGIN * unseen),
    )
    try:
        plan, corrected, again, solution = _corrected(attempt, budget, unseen)
    except SolverTimeoutError:
        raise
    except InfeasiblePlanError as exc:
        raise OverByLiveness(over_by_liveness(budget, live, mesh)) from exc
    if corrected.peak_bytes > budget:
        raise OverByLiveness(over_by_liveness(budget, corrected, mesh))
    return plan, corrected, {k: times.get(k, 0.0) + again.get(k, 0.0) for k in {**times, **again}}, solution


def _corrected(attempt, budget: int, unseen: float):
    """The plan of the correction: under the budget less ``LIVENESS_MARGIN`` times ``unseen``, or,
    when no plan fits that ask, less ``unseen`` once, the least that can bring the first plan's
    program under the budget."""
    started = time.perf_counter()
    try:
        return attempt(budget - LIVENESS_MARGIN * unseen)
    except SolverTimeoutError:
        raise
    except InfeasiblePlanError:
        log.info("no plan fits that ask: solving again for %s less than the budget", format_bytes(unseen))
    refused_s = time.perf_counter() - started  # the solve that found no plan
    plan, live, times, solution = attempt(budget - unseen)
    return plan, live, {**times, "solve": times.get("solve", 0.0) + refused_s}, solution


def over_by_liveness(budget: int, live: Liveness, mesh: Mesh) -> str:
    return (
        f"no plan on {mesh} found fits memory_budget={format_bytes(budget)} per device when its program runs: the "
        f"last one holds {format_bytes(live.peak_bytes)} at its peak (forward {format_bytes(live.forward_bytes)}, "
        f"backward {format_bytes(live.backward_bytes)}, optimizer step {format_bytes(live.optimizer_bytes)}).\n"
        f"Fix: raise memory_budget to at least {live.peak_bytes} bytes ({format_bytes(live.peak_bytes)}), "
        "or plan for a larger mesh"
    )
