"""The MIP against exhaustive search and a chain dynamic program, on random small problems."""

import itertools
import math
import random

import pytest
from autopar.passes.solve.solver import Problem, SearchOptions, solve

from autopar.core.placement import R, S
from autopar.core.strategy import NodeSpace, Strategy, StrategySpace

LAYOUTS = [(R,), (S(0),), (S(1),)]


def _random_space(num_nodes: int, seed: int, *, chain: bool):
    """Random DAG: each node reads one or two earlier nodes; strategies are random layout pairs."""
    rng = random.Random(seed)
    nodes, costs, table = [], {}, {}
    for i in range(num_nodes):
        name = f"n{i}"
        if i == 0:
            args = ()
        elif chain:
            args = ((f"n{i - 1}", 0),)
        else:
            args = tuple(sorted({(f"n{rng.randrange(i)}", 0) for _ in range(rng.choice([1, 2]))}))
        strategies = list(
            dict.fromkeys(Strategy((rng.choice(LAYOUTS),), tuple(rng.choice(LAYOUTS) for _ in args)) for _ in range(4))
        )
        nodes.append(NodeSpace(name, "op", "op", args, tuple(strategies), "forward"))
        costs[name] = [rng.uniform(0, 10) for _ in strategies]
        for p, q in itertools.product(LAYOUTS, LAYOUTS):
            table[name, p, q] = 0.0 if p == q else rng.uniform(0, 10)
    space = StrategySpace(tuple(nodes), {})
    return space, costs, lambda ref, p, q: table[ref[0], p, q]


def _plan_cost(space, costs, transition, choice):
    """Compute plus every distinct (tensor, target layout) move, as the rewriter runs them."""
    by_name = space.index()
    total = sum(costs[n][k] for n, k in choice.items())
    moves = set()
    for n in space.nodes:
        strategy = n.strategies[choice[n.name]]
        for ref, need in zip(n.args, strategy.inputs):
            have = by_name[ref[0]].strategies[choice[ref[0]]].outputs[0]
            if have != need:
                moves.add((ref, have, need))
    return total + sum(transition(ref, p, q) for ref, p, q in moves)


def _brute_force(space, costs, transition):
    names = [n.name for n in space.nodes]
    best = min(
        itertools.product(*[range(len(n.strategies)) for n in space.nodes]),
        key=lambda ks: _plan_cost(space, costs, transition, dict(zip(names, ks))),
    )
    return _plan_cost(space, costs, transition, dict(zip(names, best)))


@pytest.mark.parametrize("seed", range(8))
def test_mip_matches_exhaustive_search_on_small_dags(seed):
    space, costs, transition = _random_space(6, seed, chain=False)
    solution = solve(Problem(space, costs, transition), SearchOptions(relative_gap=0.0))
    assert solution.info.status == "OPTIMAL"
    assert _plan_cost(space, costs, transition, solution.choice) == pytest.approx(
        _brute_force(space, costs, transition)
    )
    assert solution.info.objective_s == pytest.approx(_plan_cost(space, costs, transition, solution.choice))


def _chain_dp(space, costs, transition):
    best = {k: costs[space.nodes[0].name][k] for k in range(len(space.nodes[0].strategies))}
    for prev, node in zip(space.nodes, space.nodes[1:]):
        best = {
            k: costs[node.name][k]
            + min(
                best[j]
                + (
                    0.0
                    if prev.strategies[j].outputs[0] == s.inputs[0]
                    else transition((prev.name, 0), prev.strategies[j].outputs[0], s.inputs[0])
                )
                for j in best
            )
            for k, s in enumerate(node.strategies)
        }
    return min(best.values())


@pytest.mark.parametrize("seed", range(4))
def test_mip_matches_dynamic_program_on_chains(seed):
    space, costs, transition = _random_space(40, seed, chain=True)
    solution = solve(Problem(space, costs, transition), SearchOptions(relative_gap=0.0))
    assert solution.info.objective_s == pytest.approx(_chain_dp(space, costs, transition))


def test_repeated_solves_choose_the_same_plan():
    space, costs, transition = _random_space(30, 3, chain=False)
    assert solve(Problem(space, costs, transition)).choice == solve(Problem(space, costs, transition)).choice


def test_a_search_stopped_early_keeps_the_plan_it_started_from():
    """A program that takes seconds to solve, stopped after 0.3 s: started from a random plan,
    the solver returns a plan no slower than it (a better one it found, or the start itself,
    status ``START``, however busy the host), and started from the optimum, the optimum."""
    space, costs, transition = _random_space(3000, 1, chain=False)
    rng = random.Random(0)
    start = {n.name: rng.randrange(len(n.strategies)) for n in space.nodes}
    started = solve(Problem(space, costs, transition), SearchOptions(time_limit_s=0.3, start=start))
    assert started.info.status in ("FEASIBLE", "OPTIMAL", "START")
    assert _plan_cost(space, costs, transition, started.choice) <= _plan_cost(space, costs, transition, start) + 1e-6
    best = solve(Problem(space, costs, transition))
    again = solve(Problem(space, costs, transition), SearchOptions(time_limit_s=0.3, start=best))
    assert (
        _plan_cost(space, costs, transition, again.choice) <= _plan_cost(space, costs, transition, best.choice) + 1e-6
    )


def test_a_program_too_big_to_solve_in_time_returns_a_plan_no_slower_than_the_hand_layouts():
    import torch
    from autopar.examples.llama import Llama, LlamaConfig

    import autopar

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, dim=64, num_heads=4, num_kv_heads=2, hidden=128, num_layers=4, max_seq=32)
    model, inputs = Llama(cfg), (torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32)))
    mesh = autopar.Mesh((2, 2), ("dp", "tp"))
    plan = autopar.plan(model, mesh, inputs, hardware="cpu", solver_time_limit_s=1.0, share_layers=False)
    assert plan.solver.num_variables > 300_000
    assert plan.solver.status in ("LAYOUT", "FEASIBLE", "OPTIMAL")
    assert plan.solver.status != "LAYOUT" or plan.solver.layout in (
        "data parallel",
        "fully sharded",
        "sharded over dp",
        "sharded over tp",
        "tensor parallel over dp",
        "tensor parallel over tp",
        "fully sharded over tp, tensor parallel over dp",
        "fully sharded over dp, tensor parallel over tp",
    )

    def megatron(name: str) -> tuple[str, str]:
        leaf = name.split(".")[-2]
        return (
            ("R", "S(0)") if leaf in ("wq", "wk", "wv", "w1", "w3") else ("R", "S(1)" if leaf in ("wo", "w2") else "R")
        )

    hands = {  # DDP, FSDP and Megatron by hand, their other ops planned by the solver
        "ddp": ({"idx": ("S(0)", "S(0)"), "targets": ("S(0)", "S(0)")}, lambda name: ("R", "R")),
        "fsdp": ({"idx": ("S(0)", "S(0)"), "targets": ("S(0)", "S(0)")}, lambda name: ("S(0)", "S(0)")),
        "megatron": ({"idx": ("S(0)", "R"), "targets": ("S(0)", "R")}, megatron),
    }
    for hand_name, (batch, params) in hands.items():
        pins = {**batch, **{name: params(name) for name, _ in model.named_parameters()}}
        hand = autopar.plan(model, mesh, inputs, hardware="cpu", pins=pins, share_layers=True)
        assert plan.predicted_step_s <= hand.predicted_step_s * (1 + 1e-6), hand_name


def test_a_search_under_a_budget_gives_up_only_while_it_has_no_plan():
    from types import SimpleNamespace

    from autopar.passes.solve.highs_child import _give_up_without_solution

    def event(running_time, primal_bound):
        data_in = SimpleNamespace(user_interrupt=False)
        return SimpleNamespace(
            data_out=SimpleNamespace(running_time=running_time, mip_primal_bound=primal_bound),
            data_in=data_in,
            interrupt=lambda: setattr(data_in, "user_interrupt", True),
        )

    cases = {(5.0, float("inf")): False, (20.0, float("inf")): True, (20.0, 1.5e9): False, (90.0, 1.5e9): False}
    for (seconds, bound), interrupted in cases.items():
        e = event(seconds, bound)
        _give_up_without_solution(e, 20.0)
        assert e.data_in.user_interrupt is interrupted, (seconds, bound)


def _program_relaxed_apart():
    """min x2 + 0.1 y with x1 + x2 = 1 and 2y = x1 (x1, x2, y binary): the relaxation picks
    x1 = 1, y = 0.5, which no integer y meets; the plan is x2 = 1, y = 0, objective 1."""
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("HIGHS")
    x1, x2, y = solver.BoolVar("x1"), solver.BoolVar("x2"), solver.BoolVar("y")
    solver.Add(x1 + x2 == 1)
    solver.Add(2 * y == x1)
    solver.Minimize(x2 + 0.1 * y)
    return solver, (x1, x2, y)


def _program_relaxed_whole():
    """Two ops choosing one of two strategies each and a binary keep choice per op that the
    relaxation leaves fractional: min Σ cost·x + 0.5·k with k_i ≥ x_i1 − 0.5. Optimum 2.5."""
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("HIGHS")
    x = [[solver.BoolVar(f"x{i}{k}") for k in range(2)] for i in range(2)]
    keep = [solver.BoolVar(f"k{i}") for i in range(2)]
    for i in range(2):
        solver.Add(sum(x[i]) == 1)
        solver.Add(keep[i] >= x[i][1] - 0.5)
    solver.Minimize(2 * x[0][0] + 1 * x[0][1] + 1 * x[1][0] + 3 * x[1][1] + 0.5 * sum(keep))
    return solver, [v for row in x for v in row]


def test_a_dive_keeps_the_strategies_the_relaxation_picks_and_searches_the_rest():
    from autopar.passes.solve.highs_child import dive, program
    from ortools.linear_solver import linear_solver_pb2

    solver, strategies = _program_relaxed_whole()
    model = linear_solver_pb2.MPModelProto()
    solver.ExportModelToProto(model)
    plan = dive(program(model), [v.index() for v in strategies], 1e-6, 10.0)
    assert [round(plan[v.index()]) for v in strategies] == [0, 1, 1, 0]
    assert [round(plan[i]) for i in (4, 5)] == [1, 0]  # op 0 keeps, as its strategy needs, op 1 not
    solver, variables = _program_relaxed_apart()
    model = linear_solver_pb2.MPModelProto()
    solver.ExportModelToProto(model)
    assert dive(program(model), [variables[0].index(), variables[1].index()], 1e-6, 10.0) is None


def test_a_search_from_a_dive_proves_the_same_optimum_and_without_one_where_the_dive_finds_nothing():
    from autopar.passes.solve.mip import solve_before_deadline
    from ortools.linear_solver import pywraplp

    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 1e-6)
    solver, strategies = _program_relaxed_whole()
    status, values, objective, _ = solve_before_deadline(solver, params, 10.0, dive=strategies)
    assert (status, round(objective, 6)) == (pywraplp.Solver.OPTIMAL, 2.5)
    solver, variables = _program_relaxed_apart()
    status, values, objective, _ = solve_before_deadline(solver, params, 10.0, dive=variables[:2])
    assert (status, round(objective, 6)) == (pywraplp.Solver.OPTIMAL, 1.0)
    assert [round(values[v.index()]) for v in variables] == [0, 1, 0]


def test_a_program_without_memory_rows_is_searched_when_its_relaxation_is_fractional():
    """``plain``: an integral relaxation answers the program, a fractional one is searched, an
    infeasible one proves that no plan exists."""
    from autopar.passes.solve.mip import solve_before_deadline
    from ortools.linear_solver import pywraplp

    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 1e-6)
    solver, variables = _program_relaxed_apart()  # relaxed: objective 0.05, fractional
    status, values, objective, bound = solve_before_deadline(solver, params, 10.0, plain=True)
    assert (status, round(objective, 6), round(bound, 6)) == (pywraplp.Solver.OPTIMAL, 1.0, 1.0)
    assert [round(values[v.index()]) for v in variables] == [0, 1, 0]
    solver, variables = _program_relaxed_apart()
    solver.Add(variables[1] == 0)  # now the relaxation's plan is the only one, and it is fractional
    assert solve_before_deadline(solver, params, 10.0, plain=True)[0] == pywraplp.Solver.INFEASIBLE
    solver = pywraplp.Solver.CreateSolver("HIGHS")
    x = [solver.BoolVar(f"x{k}") for k in range(3)]
    solver.Add(sum(x) == 1)
    solver.Minimize(3 * x[0] + 1 * x[1] + 2 * x[2])  # the relaxation is integral: x1 = 1
    status, values, objective, bound = solve_before_deadline(solver, params, 10.0, plain=True)
    assert (status, objective, bound, [values[v.index()] for v in x]) == (pywraplp.Solver.OPTIMAL, 1.0, 1.0, [0, 1, 0])
    solver.Add(x[0] + x[1] + x[2] >= 2)  # and infeasible
    assert solve_before_deadline(solver, params, 10.0, plain=True)[0] == pywraplp.Solver.INFEASIBLE


@pytest.mark.parametrize("seed", range(3))
def test_a_search_from_a_dive_finds_the_optimum_of_random_dags(seed, monkeypatch):
    from autopar.passes.solve import solver as solver_module
    from autopar.passes.solve.highs_child import dive, program
    from ortools.linear_solver import linear_solver_pb2

    space, costs, transition = _random_space(40, seed, chain=False)
    plain = solve(Problem(space, costs, transition), SearchOptions(relative_gap=1e-9))
    original, dived_from = solver_module.solve_before_deadline, []

    def with_dive(solver, params, time_limit_s, hint=(), **kwargs):
        strategies = [v for v in solver.variables() if v.name().startswith("x[")]
        model = linear_solver_pb2.MPModelProto()
        solver.ExportModelToProto(model)
        dived_from.append(dive(program(model), [v.index() for v in strategies], 1e-9, 10.0))
        return original(solver, params, time_limit_s, hint, **{**kwargs, "dive": strategies, "plain": False})

    monkeypatch.setattr(solver_module, "solve_before_deadline", with_dive)
    dived = solve(Problem(space, costs, transition), SearchOptions(relative_gap=1e-9))
    assert dived_from[0] is not None
    assert dived.info.objective_s == pytest.approx(plain.info.objective_s, rel=1e-9)
    assert _plan_cost(space, costs, transition, dived.choice) == pytest.approx(
        _plan_cost(space, costs, transition, plain.choice)
    )


def test_a_search_given_no_time_returns_the_fastest_standard_layout_and_says_so(monkeypatch):
    import torch
    from autopar.examples.mlp import MLP

    import autopar

    # HiGHS past its deadline with no plan
    monkeypatch.setattr("autopar.passes.solve.solver.solve_before_deadline", lambda *args, **kwargs: None)
    torch.manual_seed(0)
    plan = autopar.plan(
        MLP(16, 32), autopar.Mesh((2,), ("dp",)), (torch.randn(8, 16), torch.randn(8, 16)), hardware="h100"
    )
    layouts = ("data parallel", "fully sharded", "tensor parallel over dp")
    assert plan.solver.status == "LAYOUT" and plan.solver.layout in layouts
    assert f"solver: LAYOUT, the {plan.solver.layout} layout" in str(plan)
    assert plan.predicted_step_s > 0


def test_a_long_search_reports_its_progress(caplog):
    """The child writes a line at every better plan, and every ``PROGRESS_EVERY_S`` without one,
    once the search has run ``PROGRESS_AFTER_S``; the planning process logs each."""
    import io
    import logging
    import os
    from types import SimpleNamespace

    from autopar.passes.solve.highs_child import PROGRESS_AFTER_S, PROGRESS_EVERY_S, _Progress
    from autopar.passes.solve.mip import _report_progress
    from highspy import cb

    def event(seconds, improving=False, objective=math.nan, primal=math.inf, dual=-math.inf):
        kind = (
            cb.HighsCallbackType.kCallbackMipImprovingSolution
            if improving
            else cb.HighsCallbackType.kCallbackMipInterrupt
        )
        data = SimpleNamespace(
            running_time=seconds, objective_function_value=objective, mip_primal_bound=primal, mip_dual_bound=dual
        )
        return SimpleNamespace(callback_type=kind, data_out=data)

    out = io.BytesIO()
    progress = _Progress(out)
    start = PROGRESS_AFTER_S
    for e in (
        event(start / 2, improving=True, objective=9.0, dual=1.0),  # a short search says nothing
        event(start),  # no plan yet
        event(start + 1),  # too soon after the last line
        event(start + 2, improving=True, objective=2.0),  # a plan, no bound yet
        event(start + 3, improving=True, objective=1.0, dual=0.5),  # a better plan
        event(start + 3 + PROGRESS_EVERY_S / 2, primal=1.0, dual=0.8),
        event(start + 3 + PROGRESS_EVERY_S, primal=1.0, dual=0.9),
    ):
        progress(e)
    lines = out.getvalue().decode().splitlines()
    assert [tuple(float(x) for x in line.split()) for line in lines] == [
        (start, 0, math.inf),
        (start + 2, 1, math.inf),
        (start + 3, 1, 0.5),
        (start + 3 + PROGRESS_EVERY_S, 1, pytest.approx(0.1)),
    ]
    read, write = os.pipe()
    with os.fdopen(write, "w") as pipe:
        pipe.write(out.getvalue().decode() + "12")  # the last line cut short: the child ended mid-line
    with caplog.at_level(logging.INFO, logger="autopar"):
        _report_progress(read)
    assert [r.getMessage() for r in caplog.records] == [
        f"search: {start:.0f} s, no plan found yet",
        f"search: {start + 2:.0f} s, a plan found, no bound on the best yet",
        f"search: {start + 3:.0f} s, the best plan so far is within 50.00% of the bound",
        f"search: {start + 3 + PROGRESS_EVERY_S:.0f} s, the best plan so far is within 10.00% of the bound",
    ]
    read, write = os.pipe()
    os.close(read)  # the planning process is gone: the search goes on without reporting
    unread = _Progress(os.fdopen(write, "wb", buffering=0))
    for seconds in (start, start + PROGRESS_EVERY_S):
        unread(event(seconds, improving=True, objective=1.0, dual=0.5))
    assert unread.out is None


def test_a_search_with_no_plan_to_give_returns_a_standard_layout_completed_as_by_hand(monkeypatch):
    """The search finds no plan in time: the plan is the fastest standard layout, each layout's
    parameters pinned and the rest searched, as a user pinning them by hand would plan them, not
    only as the layout is completed op by op (1.5x slower here)."""
    import torch
    from autopar.examples.llama import Llama, LlamaConfig

    import autopar
    from autopar.core.errors import SolverTimeoutError
    from autopar.planner import _Problem

    cfg = LlamaConfig(vocab_size=32768, dim=64, num_heads=4, num_kv_heads=2, hidden=128, num_layers=1, max_seq=16)
    with torch.device("meta"):
        model = Llama(cfg)
        inputs = (torch.randint(0, 32768, (4, 16)), torch.randint(0, 32768, (4, 16)))
    mesh = autopar.Mesh((2, 2), ("dp", "tp"))
    searched = autopar.plan(model, mesh, inputs, hardware="h100")
    replicated = {name: ("R", "R") for name, _ in model.named_parameters()}
    by_hand = autopar.plan(model, mesh, inputs, hardware="h100", pins=replicated)

    def no_plan_in_time(self, solver_budget):
        raise SolverTimeoutError("no plan", solve_s=0.0, num_variables=0, num_constraints=0)

    monkeypatch.setattr(_Problem, "solved_under", no_plan_in_time)
    plan = autopar.plan(model, mesh, inputs, hardware="h100")  # the layouts completed within the default limit
    assert plan.solver.status == "LAYOUT" and plan.solver.layout == "data parallel"
    assert all(p == (R, R) for p in plan.placements.values())
    assert plan.predicted_step_s == pytest.approx(by_hand.predicted_step_s, rel=1e-6)
    assert searched.predicted_step_s <= plan.predicted_step_s * (1 + 1e-6)
