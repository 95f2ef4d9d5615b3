"""Running the plan's integer program (:mod:`autopar.passes.solver`,
:mod:`autopar.passes.memory_program`): the units of its coefficients, and the solver in a
forked child that is given up at a deadline."""

import array
import multiprocessing as mp
import os

from ortools.linear_solver import pywraplp

from autopar.errors import InfeasiblePlanError

SCALE = 1e9  # seconds -> nanoseconds, keeps coefficients in the solver's comfortable range
MEMORY_SCALE = 1e-6  # bytes -> megabytes, likewise


def solve_before_deadline(solver, params, deadline_s: float):
    """Run the solver in a forked child and give up at ``deadline_s``: MIP solvers honour their
    own time limit only between steps, not inside a long root relaxation. Returns ``(status,
    variable values, objective, bound)``, or ``None`` when the deadline passed."""
    if "fork" not in mp.get_all_start_methods():
        status = solver.Solve(params)
        return status, [v.solution_value() for v in solver.variables()], solver.Objective().Value(), solver.Objective().BestBound()
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_solve_child, args=(solver, params, send), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(deadline_s):
            return None
        return receive.recv()
    except EOFError:
        raise InfeasiblePlanError(f"the MIP solver stopped without an answer (exit code {child.exitcode})") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()


def _solve_child(solver, params, send) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # HiGHS prints a banner on stdout whatever its output setting
    status = solver.Solve(params)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        send.send((status, None, None, None))
        send.close()
        return
    objective = solver.Objective()
    values = array.array("d", (v.solution_value() for v in solver.variables()))
    send.send((status, values, objective.Value(), objective.BestBound()))
    send.close()
