"""Optimizer state stepped in host memory (ZeRO-Offload); the copies to and from host memory
are the ops of :mod:`autopar.core.offload_ops`."""

import torch
from autopar.runtime.state import as_dtensor, local_of
from torch.distributed.tensor import DTensor


class HostOptimizer(torch.optim.Optimizer):
    """An optimizer whose state for some parameters lives in host memory, stepped there.

    ``params`` are the parameters of a :class:`~autopar.runtime.module.ParallelModule`
    (DTensors, or plain tensors); those in ``on_host`` get a host copy of their piece (pinned on
    CUDA, laid out as the parameter) that an inner optimizer of class ``optimizer_class``
    steps, with its state: each step copies their gradients to the host, steps there, and
    copies the new values back. The other parameters are stepped on the device as usual. Its
    ``param_groups`` are the inner optimizer's, so learning-rate schedulers work.
    """

    def __init__(self, params, on_host: set[int], optimizer_class: type[torch.optim.Optimizer], **options):
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        inner_params = []
        for p in params:
            if id(p) in on_host:
                local = local_of(p).detach()
                host = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda).copy_(local)
                host = (as_dtensor(host, p) if isinstance(p, DTensor) else host).requires_grad_(True)
                self._pairs.append((p, host))
                inner_params.append(host)
            else:
                inner_params.append(p)
        self.inner = optimizer_class(inner_params, **options)
        super().__init__(inner_params, self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    @property
    def host_params(self) -> list[torch.Tensor]:
        """The host copies of the parameters stepped on the host."""
        return [host for _, host in self._pairs]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self._pairs:
            p.grad = None
        self.inner.zero_grad(set_to_none)

    _step_supports_amp_scaling = True
    """So that ``torch.amp.GradScaler.step`` hands this optimizer the scaler, which it refuses:
    the scaler would unscale and check only the gradients on the device, and the state stepped on
    the host would take gradients still scaled."""

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is not None:
            raise RuntimeError(
                "torch.amp.GradScaler cannot step an optimizer whose state the plan keeps in host memory: it would "
                "unscale only the gradients on the device. Fix: compile without offloading optimizer state (a "
                "larger memory_budget), or train in bfloat16 (MixedPrecision), which needs no loss scaling"
            )
        copied = False
        for p, host in self._pairs:
            if p.grad is None:
                host.grad = None
                continue
            grad = local_of(p.grad)
            copied = copied or grad.is_cuda
            grad = grad.to("cpu", non_blocking=grad.is_cuda)
            host.grad = as_dtensor(grad, host) if isinstance(host, DTensor) else grad
        if copied:
            torch.cuda.synchronize()
        loss = self.inner.step(closure)
        for p, host in self._pairs:
            local_of(p).copy_(local_of(host), non_blocking=True)
        return loss

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)
