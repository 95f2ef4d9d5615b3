"""The model's settings that key its programs (``autopar.runtime.calls.modes``)."""

import functools

import torch
from autopar.runtime.calls import modes
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.utils import prune


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


class _Scale:
    def __init__(self, scale: float):
        self.scale = scale

    def hook(self, module, args, out):
        return out * self.scale


def _times(module, args, out, scale):
    return out * scale


def test_hooks_that_compute_otherwise_key_otherwise_however_they_are_written():
    def default(scale):
        return lambda module, args, out, s=scale: out * s

    def unassigned():
        if False:
            factor = 1.0
        return lambda module, args, out: out * factor  # noqa: F821 (a cell never assigned)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    for make in (lambda s: _Scale(s).hook, lambda s: functools.partial(_times, scale=s), default):
        keys = []
        for scale in (2.0, 3.0):
            handle = model[0].register_forward_hook(make(scale))
            keys.append(modes(model))
            handle.remove()
        assert keys[0] != keys[1]
    handle = model[0].register_forward_hook(unassigned())
    assert "0 hooks" in dict(modes(model)[1])
    handle.remove()


def test_torchs_hooks_that_change_values_are_keyed():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    before = modes(model)
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    assert modes(model) != before
