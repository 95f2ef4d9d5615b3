"""The model's settings that key its programs (``autopar.runtime.calls.modes``)."""

import torch
from autopar.runtime.calls import modes
from torch.distributed._tools.mem_tracker import MemTracker


def _scaled(scale: float):
    return lambda module, args, out: out * scale


def test_hooks_key_by_what_they_compute_and_torchs_instrumentation_is_left_out():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    keys = []
    for scale in (2.0, 2.0, 3.0):  # registered again each step, as a logger or a schedule does
        handle = model[0].register_forward_hook(_scaled(scale))
        keys.append(modes(model))
        handle.remove()
    assert keys[0] == keys[1] != keys[2]
    assert "0 hooks" in dict(keys[0][1]) and keys[0] != modes(model)
    with MemTracker():
        assert modes(model) == modes(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_unfreezing_a_parameter_changes_the_key():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.requires_grad_(False)
    frozen = modes(model)
    model[0].weight.requires_grad_(True)
    assert modes(model) != frozen
