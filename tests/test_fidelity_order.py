"""How the fidelity benchmark compares the predicted order of plans with the measured one."""

from benchmarks.fidelity import _order


def _plan(layout, predicted, rounds):
    return {
        "layout": layout,
        "predicted_s": predicted,
        "measured_s": sum(rounds) / len(rounds),
        "measured_round_s": rounds,
    }


def test_a_pair_measured_apart_in_every_round_is_ordered():
    order = _order([_plan("ddp", 1.0, [1.0, 1.1, 0.9]), _plan("fsdp", 2.0, [1.5, 1.6, 1.4])])
    assert order == {"matches": True, "contradicted": [], "unresolved": []}


def test_a_pair_measured_in_reverse_in_every_round_is_contradicted():
    order = _order([_plan("ddp", 1.0, [1.5, 1.6, 1.4]), _plan("fsdp", 2.0, [1.0, 1.1, 0.9])])
    assert order == {"matches": False, "contradicted": [["ddp", "fsdp"]], "unresolved": []}


def test_a_pair_whose_rounds_disagree_is_unresolved_whatever_its_means():
    faster_mean = _order([_plan("ddp", 1.0, [1.0, 1.2, 1.0]), _plan("fsdp", 2.0, [1.1, 1.1, 1.1])])
    slower_mean = _order([_plan("ddp", 1.0, [1.0, 1.5, 1.0]), _plan("fsdp", 2.0, [1.1, 1.1, 1.1])])
    assert faster_mean == {"matches": True, "contradicted": [], "unresolved": [["ddp", "fsdp"]]}
    assert slower_mean == {"matches": False, "contradicted": [], "unresolved": [["ddp", "fsdp"]]}


def test_plans_predicted_within_five_percent_are_not_ordered():
    order = _order([_plan("auto", 1.0, [2.0, 2.0]), _plan("ddp", 1.04, [1.0, 1.0])])
    assert order == {"matches": True, "contradicted": [], "unresolved": []}
