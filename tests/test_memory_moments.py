"""The solver counts memory at each moment of the backward, as the per-rank program holds it:
activations until their last read, gradients from when they are made. Its peak is then the
program's liveness peak, and a budget the program fits needs no recomputation."""

import pytest
import torch
from autopar.cost_model.estimate import CostModel, memory_terms
from autopar.cost_model.hardware import resolve_profile
from autopar.examples import make_example
from autopar.examples.gpt import GPT, GPTConfig
from autopar.passes.analysis.capture import capture
from autopar.passes.analysis.liveness import step_liveness
from autopar.passes.lower.liveness import plan_liveness
from autopar.passes.lower.partition import boxed, partition
from autopar.passes.lower.rewrite import rewrite
from autopar.passes.propagation.propagate import propagate
from autopar.passes.solve.planning import moment_bytes
from autopar.passes.solve.remat import activation_space
from autopar.passes.solve.solver import Problem, solve
from torch import fx

import autopar
from autopar.core.placement import S
from autopar.planner import plan_captured
from tests.cases import BYTES_DEAR, SYNTHETIC

MESH = autopar.Mesh((4,), ("dp",))


@pytest.fixture(scope="module", params=["gpt", "bert", "llama", "moe"])
def planned(request):
    model, batch = make_example(request.param)
    captured = capture(model, batch)
    return captured, plan_captured(captured, MESH, hardware="h100")


def test_the_solvers_peak_is_the_programs_liveness_peak(planned):
    """Counted as one sum (every gradient and every activation at once) it was 10-22% above;
    with one op's output for what a phase holds of its own values, up to 4% (GPT, BERT and the
    MoE now count within 0.1%, the LLaMA 2.5% above)."""
    captured, plan = planned
    live = plan_liveness(captured, plan).peak_bytes
    assert plan.memory.moment_bytes == plan.memory.peak_bytes
    assert abs(plan.memory.peak_bytes - live) <= 0.03 * live, (plan.memory.peak_bytes, live)


def _vocabulary_heavy():
    """A GPT whose logits outweigh the rest of the model, as the 128k vocabulary of the
    LLaMA-3-8B shape."""
    model = GPT(GPTConfig(vocab_size=4096, dim=32, num_heads=2, num_layers=1, tie_embeddings=False))
    return capture(model, (torch.randint(0, 4096, (8, 32)), torch.randint(0, 4096, (8, 32))))


def test_a_large_vocabularys_loss_is_counted_whole():
    """What the forward holds while its last ops run is counted without the activations kept
    after them: on 2x2 the count was 17% above the program's peak, with the log-softmax and the
    one-hot target counted beside the logits that are made before them."""
    captured = _vocabulary_heavy()
    for mesh in (MESH, autopar.Mesh((2, 2), ("dp", "tp"))):
        plan = plan_captured(captured, mesh, hardware="h100")
        live = plan_liveness(captured, plan).peak_bytes
        assert abs(plan.memory.peak_bytes - live) <= 0.02 * live, (mesh, plan.memory.peak_bytes, live)


def test_a_split_backward_op_runs_in_the_backward():
    """With the vocabulary split, the log-softmax's backward runs on each rank's piece, and the
    part of it that reads no gradient (the piece's probabilities, the exp of the log-softmax)
    stays in the backward: made in the forward, it was one more value of the logits' size alive
    there, saved instead of the log-softmax."""
    captured = _vocabulary_heavy()
    mesh = autopar.Mesh((4,), ("tp",))
    plan = plan_captured(captured, mesh, hardware=BYTES_DEAR, pins={"tok.weight": "S(0)", "head.weight": "S(0)"})
    assert plan.node("_log_softmax").outputs == ((S(1),),)
    joint = rewrite(captured, plan, coordinate=(0,), group_names=["tp"])
    parts = partition(
        joint,
        [k.kind == "tangent" for k in captured.inputs],
        [None if k is None else k.kind == "grad" for k in captured.outputs],
    )
    exps = [n.name for n in parts.forward.graph.nodes if n.target is torch.ops.aten.exp.default]
    assert len(exps) == 1, exps  # the log-softmax's own


def test_a_budget_the_program_fits_needs_no_recomputation(planned):
    """5% above the program's peak: as one sum, every one of these plans was over it."""
    captured, plan = planned
    budgeted = plan_captured(captured, MESH, hardware="h100", memory_budget=int(plan.peak_memory_bytes * 1.05))
    assert budgeted.predicted_step_s == pytest.approx(plan.predicted_step_s, rel=1e-6)
    assert not any(n.activation == "recompute" and n.activation_bytes for n in budgeted.nodes)
    assert budgeted.peak_memory_bytes <= budgeted.memory_budget_bytes


@pytest.mark.parametrize("offload", [False, True], ids=["recompute on 4 ranks", "offload on one device"])
def test_the_program_of_a_plan_under_a_budget_fits_it(offload):
    """The solver's count is what a budget is planned by; the per-rank program's liveness is what
    must fit. On 4 ranks the fastest plan by the count holds more when it runs (a layer's
    parameters gathered again for the backward in one bucket, which the solver counts one at a
    time), and planning corrects it once (``autopar.budget_check.within_budget``)."""
    from tests.runtime.test_memory_budget import MESH as FOUR_RANKS
    from tests.runtime.test_memory_budget import WITH_HOST, _model, replicated_and_budget

    model, batches = _model(num_layers=4 if offload else 2)
    if offload:
        mesh, hardware = autopar.Mesh((1,), ("x",)), WITH_HOST
        budget = int(autopar.plan(model, mesh, batches[0], hardware=hardware).peak_memory_bytes * 0.4)
    else:
        (mesh, hardware), (_, budget) = (FOUR_RANKS, SYNTHETIC), replicated_and_budget(model, batches[0])
    captured = capture(model, batches[0])
    plan = plan_captured(captured, mesh, hardware=hardware, memory_budget=budget)
    assert any(n.activation == ("offload" if offload else "recompute") and n.activation_bytes for n in plan.nodes)
    live = plan_liveness(captured, plan)
    assert live.peak_bytes <= budget, (live, budget)
    assert plan.memory.liveness_peak_bytes == live.peak_bytes == plan.peak_memory_bytes


_first_saved: list = []  # a weak reference to the backward's first input, and whether it was dead at the probe


def probe(value: torch.Tensor) -> torch.Tensor:
    """Records whether the backward's first input was freed by the time this runs."""
    _first_saved.append(_first_saved[0]() is None)
    return value


torch.fx.wrap("probe")


def _graphs():
    """A forward saving two 4 KiB values and a backward that reads the first, makes a 4 KiB
    value, then reads the second."""

    def forward(x):
        a, b = x * 2, x * 3
        return x.sum(), a, b

    def backward(a, b, grad):
        c = probe(a * grad)
        return c + b

    fw, bw = fx.symbolic_trace(forward), fx.symbolic_trace(backward)
    x, a, b, c, out = (torch.empty(1024) for _ in range(5))
    for node, value in zip(fw.graph.nodes, (x, a, b, torch.empty(()))):
        node.meta["val"] = value
    for node, value in zip(bw.graph.nodes, (a, b, torch.empty(()), c, c, out)):
        node.meta["val"] = value
    return fw, bw


def test_liveness_frees_a_saved_value_after_the_backwards_last_read_of_it():
    fw, bw = _graphs()
    live = step_liveness(fw, bw, ["input"])
    # the backward starts with a and b (8 KiB) and makes c (12 KiB), frees a, makes the output
    # (12 KiB); with the input's 4 KiB throughout. Holding a and b to the end it was 20 KiB.
    assert live.backward_bytes == 4 * 4096


def test_the_boxed_backward_frees_a_saved_value_after_its_last_read():
    import weakref

    _, bw = _graphs()
    freed = []
    for run in (lambda args: bw(*args), lambda args: boxed(bw)(args)):
        args = [torch.ones(1024), torch.ones(1024), torch.ones(())]
        _first_saved[:] = [weakref.ref(args[0])]
        run(args)
        freed.append(_first_saved[1])
    assert freed == [False, True]  # called with the list held, then boxed


@pytest.mark.parametrize("hardware", ["cpu", "h100"])  # without and with a host link (offload, state in host memory)
def test_the_programs_rows_and_the_plans_count_agree(hardware):
    """The least memory the integer program finds (its peak variable) is what the plan counts
    for the same choices (:func:`~autopar.passes.solve.planning.moment_bytes`)."""
    model, batch = make_example("gpt")
    captured = capture(model, batch)
    profile = resolve_profile(hardware)
    space = propagate(captured, MESH)
    costs = CostModel(captured, MESH, profile)
    node_costs = costs.node_costs(space, costs.compute_costs(space))
    memory = memory_terms(space, costs)
    acts = activation_space(captured, space, costs, "auto", offload=costs.host() is not None)
    problem = Problem(
        space, node_costs, costs.transition_s, memory=memory, minimise="memory", activations=acts, host=costs.host()
    )
    least = solve(problem)
    counted = moment_bytes(
        memory,
        acts,
        least.choice,
        least.recomputed,
        least.offloaded,
        least.prefetched,
        least.host_optimizer,
        least.host_params,
    )
    assert least.info.objective_s == pytest.approx(counted, rel=1e-4)
    assert (least.offloaded or least.host_optimizer) if hardware == "h100" else not least.offloaded
