"""The Hugging Face examples: a plan with a rule for every op, the zoo's image classifiers
captured with a rule for every op, CLIP's batch-wide loss kept whole in pipeline stages, and the
error where transformers is missing."""

import importlib.util

import pytest
from autopar.examples import check_example, make_example

import autopar

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="Hugging Face transformers is not installed (pip install -e '.[test]')"
)
@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_hugging_face_example_plans_with_a_sharding_rule_for_every_op(name):
    model, batch = make_example(name)
    assert float(model(*batch).detach()) > 0  # forward(input_ids, labels) returns the loss
    plan = autopar.plan(model, autopar.Mesh((4,), ("dp",)), batch, fallback=False)  # raises on an op with no rule
    assert set(plan.placements) == {n for n, _ in [*model.named_parameters(), *model.named_buffers()]}
    assert set(plan.inputs) == {"input_ids", "labels"}


@pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="Hugging Face transformers is not installed (pip install -e '.[test]')"
)
@pytest.mark.parametrize("name", ["vit", "resnet", "convnext", "regnet", "mobilenet_v2", "efficientnet"])
def test_every_op_of_the_zoo_image_classifiers_has_a_sharding_rule(name):
    """Each vision model of the zoo, small, captured: no op falls back to running replicated."""
    from autopar.examples.hf import zoo
    from autopar.passes.analysis.capture import capture

    from benchmarks.models import fallback_ops

    model, inputs = zoo(batch=4, seq=8, dim=16, num_layers=1)[name]()
    assert fallback_ops(capture(model, inputs)) == {}


@pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="Hugging Face transformers is not installed (pip install -e '.[test]')"
)
def test_clip_is_not_cut_into_micro_batches_and_llama_is():
    """CLIP's loss compares every image of the batch with every text: two micro-batches' losses
    are not the batch's."""
    import torch
    from autopar.examples.hf import zoo

    from autopar.core.pipeline import Pipeline

    mesh, pipeline = autopar.Mesh((2,), ("pp",)), Pipeline(axis="pp", microbatches=2)
    torch.manual_seed(0)
    model, inputs = zoo()["clip"]()
    with pytest.raises(autopar.InputError, match="several samples of the batch"):
        autopar.plan(model, mesh, inputs, pipeline=pipeline)
    model, inputs = zoo()["llama"]()
    assert autopar.plan(model, mesh, inputs, pipeline=pipeline).stages.microbatches == 2


def test_missing_transformers_is_named_with_the_command_that_installs_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else find_spec(name, *a)
    )
    with pytest.raises(
        ModuleNotFoundError,
        match=r"hf-gpt2 example .* Hugging Face transformers, which is not installed: "
        r"pip install 'transformers>=5.23,<6'",
    ):
        check_example("hf-gpt2")
    check_example("gpt")  # the built-in models need nothing more
