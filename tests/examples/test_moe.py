"""The MoE example: its routing, its check on the batch, and a plan with a rule for every op."""

import pytest
import torch
from autopar.examples import make_example
from autopar.examples.moe import routing

import autopar


def test_routing_fills_each_expert_in_token_order_first_choices_first():
    probs = torch.tensor(
        [
            [
                [0.5, 0.3, 0.2],  # token 0: experts 0, then 1
                [0.6, 0.1, 0.3],  # token 1: experts 0, then 2
                [0.7, 0.2, 0.1],
            ]
        ]
    )  # token 2: experts 0 (over capacity), then 1
    dispatch, combine, first_choice = routing(probs, top_k=2, capacity=2)
    filled = {(s, e, c) for _, s, e, c in dispatch.nonzero().tolist()}
    assert filled == {(0, 0, 0), (1, 0, 1), (0, 1, 0), (1, 2, 0), (2, 1, 1)}  # token 2's first choice dropped
    assert torch.equal(dispatch, (combine > 0).float())
    gates = {
        (0, 0, 0): 0.5 / 0.8,
        (0, 1, 0): 0.3 / 0.8,
        (1, 0, 1): 0.6 / 0.9,
        (1, 2, 0): 0.3 / 0.9,
        (2, 1, 1): 0.2 / 0.9,
    }  # the top-2 gates, normalised before the drop
    for (s, e, c), gate in gates.items():
        assert abs(float(combine[0, s, e, c]) - gate) < 1e-6
    assert first_choice[0].argmax(-1).tolist() == [0, 0, 0]


def test_moe_example_plans_with_a_sharding_rule_for_every_op():
    model, batch = make_example("moe")
    plan = autopar.plan(model, autopar.Mesh((4,), ("ep",)), batch, fallback=False)  # raises on an op with no rule
    assert set(plan.placements) == {name for name, _ in model.named_parameters()}


def test_batch_that_does_not_fill_whole_groups_is_refused():
    model, _ = make_example("moe")
    idx = torch.zeros(3, 10, dtype=torch.long)
    with pytest.raises(
        ValueError,
        match=r"30 tokens \(3 x 10\) do not split into groups of group_size=32; pass a batch whose token count",
    ):
        model(idx, idx)
