"""Parallel training of models from Hugging Face transformers, built from configurations, on 4
gloo ranks against the same training on one device, as :mod:`tests.runtime.test_graph_diff`
checks the examples (a file of its own, so that a second test worker runs it beside that one)."""

import pytest

from tests.cases import (
    NEEDS_TRANSFORMERS,
    assert_matches_one_device,
    assert_runs_the_planned_collectives,
    case_name,
    run_groups,
)

pytestmark = NEEDS_TRANSFORMERS

HUGGING_FACE = [  # models written by others: GPT-2 and LLaMA from transformers, built from configurations
    dict(model_name="hf-gpt2", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw-eps1e-6"),
    dict(model_name="hf-gpt2", mesh_shape=(4,), axis_names=("dp",), optimizer_name="adamw-eps1e-6"),
    # dropout on: every rank draws the masks one device draws and keeps its piece
    dict(model_name="hf-gpt2-dropout", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw-eps1e-6"),
    dict(model_name="hf-llama", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw"),
    dict(model_name="hf-llama", mesh_shape=(4,), axis_names=("dp",), optimizer_name="adamw"),
    # more architectures of the zoo: graph constants and index_put (Falcon), an encoder-decoder
    # shifting its labels (T5), experts with transformers' grouped matmul (Mixtral), a vision
    # transformer, a masked language model, relative attention's repeat and scatter_add
    # (DeBERTa-v2), ALiBi's baddbmm and a GeLU declared differentiable (BLOOM), a state-space model
    *(
        dict(model_name=f"zoo-{name}", mesh_shape=(2, 2), axis_names=("dp", "tp"), optimizer_name="adamw-eps1e-6")
        for name in ("falcon", "t5", "mixtral", "vit", "bert", "deberta_v2", "bloom", "mamba")
    ),
]


@pytest.fixture(scope="module")
def results():
    return run_groups(((4, HUGGING_FACE),))


@pytest.mark.slow
@pytest.mark.parametrize("case", HUGGING_FACE, ids=case_name)
def test_parallel_training_matches_one_device(results, case):
    assert_matches_one_device(results[case_name(case)])


@pytest.mark.slow
@pytest.mark.parametrize("case", HUGGING_FACE, ids=case_name)
def test_per_rank_graph_runs_exactly_the_planned_collectives(results, case):
    assert_runs_the_planned_collectives(results[case_name(case)])
