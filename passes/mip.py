"""Running the plan's integer program (:mod:`autopar.passes.solver`,
:mod:`autopar.passes.memory_program`): the units of its coefficients, and the solver in a
child process that is given up at a deadline."""

import os
import pickle
import struct
import subprocess
import sys

from ortools.linear_solver import linear_solver_pb2

from autopar.errors import InfeasiblePlanError

SCALE = 1e9  # seconds -> nanoseconds, keeps coefficients in the solver's comfortable range
MEMORY_SCALE = 1e-6  # bytes -> megabytes, likewise
CHILD = os.path.join(os.path.dirname(__file__), "highs_child.py")


def solve_before_deadline(solver, params, deadline_s: float):
    """Solve in a process of its own (:mod:`autopar.passes.highs_child`) and give up at
    ``deadline_s``: MIP solvers honour their own time limit only between steps, not inside a
    long root relaxation. Returns ``(status, variable values, objective, bound)``, or ``None``
    when the deadline passed.

    The process is a fresh interpreter given the program as a protocol buffer, not a fork of
    the planning process: that process runs the threads of torch, of a process group or of
    CUDA, and a fork can deadlock on a lock one of them held, then give no answer by any
    deadline."""
    model = linear_solver_pb2.MPModelProto()
    solver.ExportModelToProto(model)
    payload = struct.pack("dd", params.GetDoubleParam(params.RELATIVE_MIP_GAP), deadline_s) + model.SerializeToString()
    child = subprocess.Popen([sys.executable, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        out, err = child.communicate(payload, timeout=deadline_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return None
    if child.returncode != 0 or not out:
        raise InfeasiblePlanError(f"the MIP solver stopped without an answer (exit code {child.returncode}): "
                                  f"{err.decode(errors='replace').strip()[-500:]}")
    return pickle.loads(out)

