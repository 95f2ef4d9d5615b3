"""Solve one integer program with HiGHS, in a process of its own (:func:`autopar.passes.solve.mip.solve_before_deadline`
starts it as a script, so it imports HiGHS and the program's protocol buffer alone).

Reads from stdin the relative gap, the time limit in seconds, the seconds after which a search that
has found no solution yet gives up (infinite: never) and the share of the search spent in primal
heuristics (HiGHS's ``mip_heuristic_effort``), four doubles, then whether to solve the linear
relaxation alone, whether to search without presolve and the feasibility jump heuristic, whether
HiGHS may restart its search at the root, and the number of columns to dive on (four unsigned
32-bit integers) and those columns' indices (32-bit integers), then the program as an OR-Tools
``MPModelProto``; writes to stdout the pickle of ``(status, variable values, objective, bound)``
with OR-Tools' status codes, and ``None`` for the last three when no solution was found. Given a
file descriptor as its argument, it writes the search's progress there (:class:`_Progress`). The
program's ``solution_hint`` (a plan known to satisfy it, whole or in part) is the search's starting
solution: HiGHS completes a partial one with a small search of its own. Columns to dive on make the
search start from :func:`dive`'s plan instead. HiGHS is driven through ``highspy`` rather than
OR-Tools, whose HiGHS interface crashes on a program with a hint."""

import array
import math
import os
import pickle
import struct
import sys
import time

import highspy
from ortools.linear_solver import linear_solver_pb2

OPTIMAL, FEASIBLE, INFEASIBLE, NOT_SOLVED = 0, 1, 2, 6  # pywraplp.Solver's status codes
LARGEST_COST = 2.0**20
"""The largest objective coefficient HiGHS is given, after scaling by a power of two
(``user_objective_scale``). The plan's program prices in nanoseconds, so its costs span nine
orders of magnitude; past about a million, the dual simplex of the relaxation slows several-fold
against HiGHS's tolerances."""
HEADER = struct.calcsize("ddddIIII")
DIVE_SHARE = 0.5
"""The share of the time limit a dive may take, the relaxation and the search it leaves, and the
share the relaxation tried first on a program without memory rows may take
(:func:`integral_relaxation`)."""
DUAL_TASKS = 2
"""HiGHS's ``simplex_strategy`` running the dual simplex's pricing and update as parallel tasks
(SIP): the same path as the serial dual simplex, on two threads."""
RELAXATION_OPTIONS = {"presolve": "off", "parallel": "on", "simplex_strategy": DUAL_TASKS}
"""How the plan's linear relaxations are solved on their own (:func:`integral_relaxation`,
:func:`dive`): the dual simplex without presolve, with tasks in parallel."""
INTEGRAL_WITHIN = 1e-6
"""How far from 0 or 1 an integer column of a relaxation's solution may be to count as integral."""
PROGRESS_AFTER_S, PROGRESS_EVERY_S = 5.0, 10.0
"""Seconds a search runs before it reports its progress, and between reports while it finds no
better plan."""


def program(model: linear_solver_pb2.MPModelProto) -> highspy.HighsLp:
    """``model`` as HiGHS takes it (each :class:`highspy.Highs` given it keeps a copy)."""
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(model.variable), len(model.constraint)
    lp.col_cost_ = [v.objective_coefficient for v in model.variable]
    lp.col_lower_ = [v.lower_bound for v in model.variable]
    lp.col_upper_ = [v.upper_bound for v in model.variable]
    lp.row_lower_ = [c.lower_bound for c in model.constraint]
    lp.row_upper_ = [c.upper_bound for c in model.constraint]
    starts, index, value = [0], [], []
    for c in model.constraint:
        index.extend(c.var_index)
        value.extend(c.coefficient)
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = lp.num_col_, lp.num_row_
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = starts, index, value
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if v.is_integer else highspy.HighsVarType.kContinuous for v in model.variable
    ]
    lp.offset_ = model.objective_offset
    lp.sense_ = highspy.ObjSense.kMaximize if model.maximize else highspy.ObjSense.kMinimize
    return lp


def objective_scale(lp: highspy.HighsLp) -> int:
    """The power of two that brings the largest cost of ``lp`` to at most ``LARGEST_COST``
    (HiGHS reports objectives and bounds unscaled)."""
    largest = max((abs(c) for c in lp.col_cost_), default=0.0)
    return min(0, -math.ceil(math.log2(largest / LARGEST_COST))) if largest > 0 else 0


def _highs(lp: highspy.HighsLp, time_limit_s: float) -> highspy.Highs:
    """A quiet HiGHS instance holding ``lp``, stopping at ``time_limit_s``."""
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", max(time_limit_s, 0.0))
    highs.setOptionValue("user_objective_scale", objective_scale(lp))
    highs.passModel(lp)
    return highs


def relaxation(lp: highspy.HighsLp, time_limit_s: float) -> highspy.Highs:
    """A HiGHS instance holding the linear relaxation of ``lp`` (its integers made continuous)."""
    relaxed = _highs(lp, time_limit_s)
    integers = [i for i, kind in enumerate(lp.integrality_) if kind == highspy.HighsVarType.kInteger]
    relaxed.changeColsIntegrality(len(integers), integers, [highspy.HighsVarType.kContinuous] * len(integers))
    return relaxed


def _relaxed_answer(lp: highspy.HighsLp, time_limit_s: float, **options) -> tuple:
    """The answer of the linear relaxation of ``lp``, solved with HiGHS ``options``."""
    relaxed = relaxation(lp, time_limit_s)
    for name, value in options.items():
        relaxed.setOptionValue(name, value)
    relaxed.run()
    status = relaxed.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return (INFEASIBLE, None, None, None)
    if status != highspy.HighsModelStatus.kOptimal:
        return (NOT_SOLVED, None, None, None)
    value = relaxed.getInfo().objective_function_value
    return (OPTIMAL, array.array("d", relaxed.getSolution().col_value), value, value)


def dive(lp: highspy.HighsLp, columns: list[int], gap: float, time_limit_s: float) -> list[float] | None:
    """A plan to start the search from: the linear relaxation of the program ``lp`` solved, the integer
    ``columns`` it sets to 0 or 1 fixed there, and the program left searched within ``gap``
    (or until ``time_limit_s`` runs out, keeping the best plan found). ``None`` when either
    step finds nothing in time. On the plan's program the relaxation sets the strategy of
    almost every op to one of its choices, and the memory choices are what is hard: the
    LLaMA-3-8B shape under 80 GB on 8x8 H100s (108k variables), searched whole, took 37 to
    46 s to a plan within 1% of its bound over three random seeds, and 13 to 17 s over five
    from a dive: the relaxation 2 to 3 s (it set every one of the 5,536 strategy choices to 0
    or 1), the search it leaves 5 to 8 s, and from that plan the whole search 5 s to prove it
    within 0.5 to 0.8%. The relaxation is solved as :data:`RELAXATION_OPTIONS` say: on the 70B
    shape's programs of 16x64 and 128x8 H100s under 80 GB (87k and 82k variables) and the 8B
    shape's above, it took 5.8, 1.5 and 0.5 s against 3.9, 1.9 and 1.5 s with HiGHS's defaults,
    and the search it left 2.5, 1.7 and 0.7 s against 42, 1.7 and 0.7 s (the 16x64 relaxation
    ends at another vertex of the same optimum, whose fixed strategies leave an easier search)."""
    started = time.perf_counter()
    relaxed = relaxation(lp, time_limit_s)
    for name, value in RELAXATION_OPTIONS.items():
        relaxed.setOptionValue(name, value)
    relaxed.run()
    if relaxed.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    x = relaxed.getSolution().col_value
    fixed = [c for c in columns if abs(x[c] - round(x[c])) <= 1e-6]
    values = [float(round(x[c])) for c in fixed]
    del relaxed
    rest = _highs(lp, time_limit_s - (time.perf_counter() - started))
    rest.setOptionValue("mip_rel_gap", gap)
    rest.changeColsBounds(len(fixed), fixed, values, values)
    rest.run()
    if rest.getInfo().primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
        return None
    return list(rest.getSolution().col_value)


def integral_relaxation(lp: highspy.HighsLp, time_limit_s: float) -> tuple | None:
    """The answer of program ``lp`` when its linear relaxation, solved without presolve by the
    dual simplex with tasks in parallel (``DUAL_TASKS``) within ``time_limit_s``, proves it:
    infeasible, or optimal with every integer column integral (then that solution is the
    program's optimum, its objective its bound), or ``NOT_SOLVED`` when it did not finish in time.
    ``None`` when it is fractional.

    The plan's program without memory rows almost always relaxes to an integral solution (the
    transports are tight), and HiGHS's dual simplex on the relaxation alone takes half to two
    thirds of the time the same relaxation takes at the root of HiGHS's search, which runs
    symmetry detection and its heuristics beside it: Hugging Face Gemma-2 and T5 of 2 layers
    on 2x2, 10 and 16 s against 17 and 28 s (the search found the same plan), the LLaMA-3-8B
    shape at 8 layers and autoparallel's stack at 32 blocks on 8x8, 0.4 and 2.3 s against 1.6
    and 3.2 s. On two cores the dual simplex with tasks in parallel takes the same iterations
    1.2 to 1.4 times faster than the serial one (Gemma-2 7.1 s, T5 11.0 s)."""
    answer = _relaxed_answer(lp, time_limit_s, **RELAXATION_OPTIONS)
    x = answer[1]
    integers = (i for i, kind in enumerate(lp.integrality_) if kind == highspy.HighsVarType.kInteger)
    if answer[0] == OPTIMAL and any(abs(x[i] - round(x[i])) > INTEGRAL_WITHIN for i in integers):
        return None
    return answer


def _give_up_without_solution(event, give_up_s: float) -> None:
    if event.data_out.running_time >= give_up_s and not math.isfinite(event.data_out.mip_primal_bound):
        event.interrupt()


class _Progress:
    """Lines of ``seconds found gap`` written to ``out`` (unbuffered bytes) once the search has run ``PROGRESS_AFTER_S``
    (``found``: 1 once it has a plan; ``gap`` the relative distance of its best plan from the
    bound, ``inf`` without either): at every better plan, and every ``PROGRESS_EVERY_S`` between
    them."""

    def __init__(self, out) -> None:
        self.out, self.last = out, PROGRESS_AFTER_S - PROGRESS_EVERY_S

    def __call__(self, event) -> None:
        data = event.data_out
        if self.out is None:
            return
        improving = event.callback_type == highspy.cb.HighsCallbackType.kCallbackMipImprovingSolution
        if data.running_time < PROGRESS_AFTER_S or not (improving or data.running_time - self.last >= PROGRESS_EVERY_S):
            return
        best = data.objective_function_value if improving else data.mip_primal_bound
        found = math.isfinite(best)
        gap = abs(best - data.mip_dual_bound) / max(abs(best), 1e-9) if found else math.inf
        self.last = data.running_time
        try:
            self.out.write(f"{data.running_time:.1f} {int(found)} {gap:.6g}\n".encode())
        except OSError:  # nobody reads: the search goes on without reporting
            self.out.close()
            self.out = None


def main() -> None:
    data = sys.stdin.buffer.read()
    started = time.perf_counter()
    gap, time_limit_s, give_up_s, heuristic_effort, relax, plain, restarts, count = struct.unpack(
        "ddddIIII", data[:HEADER]
    )
    columns = list(array.array("i", data[HEADER : HEADER + 4 * count]))
    model = linear_solver_pb2.MPModelProto.FromString(data[HEADER + 4 * count :])
    result = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # HiGHS prints a banner on stdout whatever its output setting
    lp = program(model)
    if relax or plain:
        answer = _relaxed_answer(lp, time_limit_s) if relax else integral_relaxation(lp, DIVE_SHARE * time_limit_s)
        if relax or (answer is not None and answer[0] != NOT_SOLVED):
            pickle.dump(answer, result)
            result.close()
            return
        plain = answer is None  # a fractional relaxation: search as plain programs are searched
    start = dive(lp, columns, gap, DIVE_SHARE * time_limit_s) if columns else None
    spent = time.perf_counter() - started
    highs = _highs(lp, time_limit_s - spent)
    highs.setOptionValue("mip_rel_gap", gap)
    highs.setOptionValue("mip_heuristic_effort", heuristic_effort)
    highs.setOptionValue("mip_allow_restart", bool(restarts))
    if plain:
        highs.setOptionValue("presolve", "off")
        highs.setOptionValue("mip_heuristic_run_feasibility_jump", False)
    if start is not None:
        solution = highspy.HighsSolution()
        solution.col_value, solution.value_valid = start, True
        highs.setSolution(solution)
    elif model.solution_hint.var_index:
        hint = model.solution_hint
        highs.setSolution(len(hint.var_index), list(hint.var_index), list(hint.var_value))
    give_up_s -= spent
    if give_up_s < time_limit_s - spent:
        highs.cbMipInterrupt.subscribe(lambda event: _give_up_without_solution(event, give_up_s))
    if len(sys.argv) > 1:  # a file descriptor for lines of progress
        progress = _Progress(os.fdopen(int(sys.argv[1]), "wb", buffering=0))
        highs.cbMipImprovingSolution.subscribe(progress)
        highs.cbMipInterrupt.subscribe(progress)
    highs.run()
    status, info = highs.getModelStatus(), highs.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        answer = (INFEASIBLE, None, None, None)
    elif info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible:
        values = array.array("d", highs.getSolution().col_value)
        bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else info.objective_function_value
        answer = (
            OPTIMAL if status == highspy.HighsModelStatus.kOptimal else FEASIBLE,
            values,
            info.objective_function_value,
            bound,
        )
    else:
        answer = (NOT_SOLVED, None, None, None)
    pickle.dump(answer, result)
    result.close()


if __name__ == "__main__":
    main()
