"""Solve one integer program with HiGHS, in a process of its own (:func:`autopar.passes.mip.solve_before_deadline`
starts it as a script, so it imports OR-Tools alone).

Reads from stdin the relative gap and the time limit in seconds (two doubles), then the program
as an ``MPModelProto``; writes to stdout the pickle of ``(status, variable values, objective,
bound)``, with ``None`` for the last three when no solution was found."""

import array
import os
import pickle
import struct
import sys

from ortools.linear_solver import linear_solver_pb2, pywraplp


def main() -> None:
    data = sys.stdin.buffer.read()
    gap, time_limit_s = struct.unpack("dd", data[:16])
    result = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # HiGHS prints a banner on stdout whatever its output setting
    solver = pywraplp.Solver.CreateSolver("HIGHS")
    solver.LoadModelFromProto(linear_solver_pb2.MPModelProto.FromString(data[16:]))
    solver.SetTimeLimit(int(time_limit_s * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, gap)
    status = solver.Solve(params)
    if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        objective = solver.Objective()
        values = array.array("d", (v.solution_value() for v in solver.variables()))
        answer = (status, values, objective.Value(), objective.BestBound())
    else:
        answer = (status, None, None, None)
    pickle.dump(answer, result)
    result.close()


if __name__ == "__main__":
    main()
