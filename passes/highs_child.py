"""Solve one integer program with HiGHS, in a process of its own (:func:`autopar.passes.mip.solve_before_deadline`
starts it as a script, so it imports HiGHS and the program's protocol buffer alone).

Reads from stdin the relative gap, the time limit in seconds, the seconds after which a
search that has found no solution yet gives up (infinite: never) and the share of the search
spent in primal heuristics (HiGHS's ``mip_heuristic_effort``), four doubles, then the program as
an OR-Tools ``MPModelProto``; writes to stdout the pickle of ``(status, variable values,
objective, bound)`` with OR-Tools' status codes, and ``None`` for the last three when no
solution was found. The program's ``solution_hint`` (a plan known to satisfy it, whole or in
part) is the search's starting solution: HiGHS completes a partial one with a small search of
its own. HiGHS is driven through ``highspy`` rather than OR-Tools, whose HiGHS interface
crashes on a program with a hint."""

import array
import math
import os
import pickle
import struct
import sys

import highspy
from ortools.linear_solver import linear_solver_pb2

OPTIMAL, FEASIBLE, INFEASIBLE, NOT_SOLVED = 0, 1, 2, 6  # pywraplp.Solver's status codes


def load(highs: highspy.Highs, model: linear_solver_pb2.MPModelProto) -> None:
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
    lp.integrality_ = [highspy.HighsVarType.kInteger if v.is_integer else highspy.HighsVarType.kContinuous
                       for v in model.variable]
    lp.offset_ = model.objective_offset
    lp.sense_ = highspy.ObjSense.kMaximize if model.maximize else highspy.ObjSense.kMinimize
    highs.passModel(lp)
    hint = model.solution_hint
    if hint.var_index:
        highs.setSolution(len(hint.var_index), list(hint.var_index), list(hint.var_value))


def _give_up_without_solution(event, give_up_s: float) -> None:
    if event.data_out.running_time >= give_up_s and not math.isfinite(event.data_out.mip_primal_bound):
        event.interrupt()


def main() -> None:
    data = sys.stdin.buffer.read()
    gap, time_limit_s, give_up_s, heuristic_effort = struct.unpack("dddd", data[:32])
    result = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # HiGHS prints a banner on stdout whatever its output setting
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", time_limit_s)
    highs.setOptionValue("mip_rel_gap", gap)
    highs.setOptionValue("mip_heuristic_effort", heuristic_effort)
    load(highs, linear_solver_pb2.MPModelProto.FromString(data[32:]))
    if give_up_s < time_limit_s:
        highs.cbMipInterrupt.subscribe(lambda event: _give_up_without_solution(event, give_up_s))
    highs.run()
    status, info = highs.getModelStatus(), highs.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        answer = (INFEASIBLE, None, None, None)
    elif info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible:
        values = array.array("d", highs.getSolution().col_value)
        bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else info.objective_function_value
        answer = (OPTIMAL if status == highspy.HighsModelStatus.kOptimal else FEASIBLE, values,
                  info.objective_function_value, bound)
    else:
        answer = (NOT_SOLVED, None, None, None)
    pickle.dump(answer, result)
    result.close()


if __name__ == "__main__":
    main()
