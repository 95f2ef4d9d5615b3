"""Running the plan's integer program (:mod:`autopar.passes.solve.solver`,
:mod:`autopar.passes.solve.memory_program`, :mod:`autopar.passes.solve.memory_choices`): the units of its
coefficients, and the solver in a child process that is given up at a deadline."""

import array
import logging
import math
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence

from ortools.linear_solver import linear_solver_pb2

from autopar.core.errors import InfeasiblePlanError

log = logging.getLogger("autopar")

SCALE = 1e9  # seconds -> nanoseconds, keeps coefficients in the solver's comfortable range
MEMORY_SCALE = 1e-6  # bytes -> megabytes, likewise
CHILD = os.path.join(os.path.dirname(__file__), "highs_child.py")
DEADLINE_FACTOR, DEADLINE_GRACE_S = 1.1, 5.0
DEFAULT_HEURISTIC_EFFORT = 0.05  # HiGHS's own
BUDGET_HEURISTIC_EFFORT = 0.5
BUDGET_HEURISTIC_ABOVE = 50_000
"""Programs under a memory budget with more variables than this spend ``BUDGET_HEURISTIC_EFFORT``
of HiGHS's search on primal heuristics. In large ones the hard part is finding good plans, not
the bound: the LLaMA-3-8B shape under 80 GB on 8x8 H100s (108k variables), at HiGHS's
default, was still 1.2% from its bound after 90 s with two of three random seeds; at 0.5,
five seeds of five came within 0.8% in 33 to 51 s. In small ones the bound is the hard part:
the 4-rank BERT, GPT and LLaMA examples under half their peak (8k to 19k variables) proved
their plans within 0.1% in 81, 21 and 42 s at the default, and in more than 120, 34 and 56 s
at 0.5, with the same plans. Those small ones are also searched without HiGHS's restarts of the
root (``restarts``)."""


def add_row(solver, lower: float, upper: float, terms: Iterable[tuple[object, float]]):
    """Add the row ``lower <= Σ coefficient · variable <= upper`` over ``terms`` (a variable named
    more than once gets the sum of its coefficients) and return it. Rows set coefficient by
    coefficient build four times faster than OR-Tools' expressions (``solver.Add(sum(...) ==
    ...)``): about a quarter of the time building the program of a large graph took with them."""
    coefficients: dict = {}  # by variable: the program's variables are each one object, hashed by identity
    for var, coefficient in terms:
        coefficients[var] = coefficients.get(var, 0.0) + coefficient
    row = solver.Constraint(lower, upper)
    for var, coefficient in coefficients.items():
        row.SetCoefficient(var, coefficient)
    return row


def _report_progress(fd: int) -> None:
    """Log the search's progress lines from the child (:class:`~autopar.passes.solve.highs_child._Progress`)
    until it exits: the planning of a large program or one under a memory budget can take minutes."""
    with os.fdopen(fd) as lines:
        for line in lines:
            try:
                seconds, found, gap = (float(x) for x in line.split())
            except ValueError:  # a line cut short by the child's end
                continue
            if not found:
                log.info("search: %.0f s, no plan found yet", seconds)
            elif math.isinf(gap):
                log.info("search: %.0f s, a plan found, no bound on the best yet", seconds)
            else:
                log.info("search: %.0f s, the best plan so far is within %.2f%% of the bound", seconds, 100 * gap)


def solve_before_deadline(
    solver,
    params,
    time_limit_s: float,
    hint: Sequence[tuple] = (),
    give_up_without_plan_s: float = math.inf,
    heuristic_effort: float = DEFAULT_HEURISTIC_EFFORT,
    dive: Sequence = (),
    relax: bool = False,
    plain: bool = False,
    restarts: bool = True,
):
    """Solve in a process of its own (:mod:`autopar.passes.solve.highs_child`) with HiGHS's time limit
    at ``time_limit_s``, and give up on it at ``DEADLINE_FACTOR`` times that plus
    ``DEADLINE_GRACE_S``: MIP solvers honour their own time limit only between steps, not
    inside a long root relaxation. ``hint`` holds ``(variable, value)`` pairs of a solution to
    start from, whole or in part. A search that has found no solution after
    ``give_up_without_plan_s`` stops there (``NOT_SOLVED``); one that has goes on to the time
    limit or the gap. ``heuristic_effort`` is the share of the search HiGHS spends looking for
    better plans rather than proving a bound. ``dive`` lists integer variables (the strategy
    choices) for the search to start from a plan that keeps them as the program's relaxation
    sets them (:func:`autopar.passes.solve.highs_child.dive`), instead of from ``hint``. ``relax``
    solves the program's linear relaxation instead, whose objective bounds the program's. ``plain``,
    for programs without memory rows, whose relaxation is almost always integral, solves the
    relaxation first, within half the time limit, and answers with it when it is integral or
    infeasible (:func:`~autopar.passes.solve.highs_child.integral_relaxation`); the search then
    has what is left of the time limit. After a fractional relaxation it searches without HiGHS's
    presolve and feasibility-jump heuristic, which spend more than they save there (the search
    takes 1.3 to 1.8 times longer with them, on Hugging Face LLaMA and T5 of 2 layers on 2x2, the
    8-layer LLaMA-3-8B shape and autoparallel's stack on 8x8); after one that did not finish in
    time, with them. Without ``restarts`` HiGHS does not start its search over at the root after
    fixing columns there: on small programs under a memory budget, whose bound the root's cuts and
    branching raise, a restart repeats that work (the 4-rank GPT example under 60% of its peak
    proved its plan in 33 s with them and 22 s without; under 40%, in 49 and 42 s; the same
    plans). Returns ``(status, variable values, objective, bound)`` (``FEASIBLE`` with the best
    plan found when the time limit stopped the search), or ``None`` when the deadline passed.

    The process is a fresh interpreter given the program as a protocol buffer, not a fork of
    the planning process: that process runs the threads of torch, of a process group or of
    CUDA, and a fork can deadlock on a lock one of them held, then give no answer by any
    deadline."""
    model = linear_solver_pb2.MPModelProto()
    solver.ExportModelToProto(model)
    for var, value in hint:
        model.solution_hint.var_index.append(var.index())
        model.solution_hint.var_value.append(value)
    payload = (
        struct.pack(
            "ddddIIII",
            params.GetDoubleParam(params.RELATIVE_MIP_GAP),
            time_limit_s,
            give_up_without_plan_s,
            heuristic_effort,
            relax,
            plain,
            restarts,
            len(dive),
        )
        + array.array("i", [var.index() for var in dive]).tobytes()
        + model.SerializeToString()
    )
    progress, into = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, CHILD, str(into)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(into,),
        )
    except BaseException:
        os.close(progress)
        raise
    finally:
        os.close(into)
    reporter = threading.Thread(target=_report_progress, args=(progress,), daemon=True)
    reporter.start()
    try:
        out, err = child.communicate(payload, timeout=time_limit_s * DEADLINE_FACTOR + DEADLINE_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return None
    finally:
        if child.poll() is None:  # interrupted (KeyboardInterrupt): the child stops with the planning
            child.kill()
            child.wait()
        reporter.join()
    if child.returncode != 0 or not out:
        raise InfeasiblePlanError(
            f"the MIP solver stopped without an answer (exit code {child.returncode}): "
            f"{err.decode(errors='replace').strip()[-500:]}"
        )
    return pickle.loads(out)
