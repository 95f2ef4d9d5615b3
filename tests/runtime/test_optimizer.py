"""The optimizer ``pmodel.optimizer`` builds: the step implementation whose memory the plan counts."""

import torch
from autopar.runtime.module import _lean_step
from torch._subclasses.fake_tensor import FakeTensorMode


def _parameter(device: str) -> torch.Tensor:
    with FakeTensorMode():
        return torch.nn.Parameter(torch.empty(4, device=device))


def test_cuda_steps_are_fused_unless_the_caller_chose_an_implementation():
    cuda = _parameter("cuda")
    assert _lean_step(torch.optim.AdamW, {"lr": 1e-3}, [cuda]) == {"lr": 1e-3, "fused": True}
    assert _lean_step(torch.optim.SGD, {"lr": 1e-3}, [cuda]) == {"lr": 1e-3, "fused": True}
    assert _lean_step(torch.optim.AdamW, {"foreach": True}, [cuda]) == {"foreach": True}
    assert _lean_step(torch.optim.AdamW, {"fused": False}, [cuda]) == {"fused": False}


def test_host_steps_and_classes_without_a_fused_step_keep_torch_defaults():
    assert _lean_step(torch.optim.AdamW, {"lr": 1e-3}, [torch.nn.Parameter(torch.zeros(4))]) == {"lr": 1e-3}
    assert _lean_step(torch.optim.RMSprop, {"lr": 1e-3}, [_parameter("cuda")]) == {"lr": 1e-3}
