"""Host memory for what the plan offloads: activations between the forward and the backward, and
optimizer state stepped on the host (ZeRO-Offload).

``autopar::offload``, ``autopar::reload`` and ``autopar::reload_wait`` are the ops the rewriter
puts into the per-rank graph around an offloaded activation. On CUDA the copy out goes to pinned
host memory on a side stream, so it runs beside the forward compute that follows, and the
activation's device memory is reused only once the copy is done. The copy back is issued on the
same side stream (after the copies out, so it never reads a host buffer still being written)
ahead of the backward op that reads it, so that it runs beside the backward compute in between;
``reload_wait`` makes the compute stream wait for it just before that op. On a CPU device the
copies are plain copies and the wait does nothing: a CPU computes in host memory, and the
planner offers offload only for profiles with a host link.
"""

import torch

_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@torch.library.custom_op("autopar::offload", mutates_args=())
def offload(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` in host memory."""
    if x.device.type != "cuda":
        return x.clone(memory_format=torch.contiguous_format)
    side, compute = _side_stream(x.device), torch.cuda.current_stream(x.device)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
    x.record_stream(side)
    return host


@offload.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape, device="cpu")


@torch.library.custom_op("autopar::reload", mutates_args=())
def reload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (made by :func:`offload`) copied back to ``device``; on CUDA the copy runs on the
    side stream, and :func:`reload_wait` must precede the first read of the result."""
    if device.type != "cuda":
        return host.to(device, copy=True)
    with torch.cuda.stream(_side_stream(device)):
        return host.to(device, non_blocking=True)


@reload.register_fake
def _(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.new_empty(host.shape, device=device)


@torch.library.custom_op("autopar::reload_wait", mutates_args=("x",))
def reload_wait(x: torch.Tensor) -> None:
    """Make the compute stream wait for the copy that :func:`reload` made into ``x``, and keep
    ``x``'s memory from being reused before the compute stream is done with it. Declared as
    writing ``x``, so that no read of ``x`` is moved before it."""
    if x.device.type == "cuda":
        compute = torch.cuda.current_stream(x.device)
        compute.wait_stream(_side_stream(x.device))
        x.record_stream(compute)


def host_copies_done() -> None:
    """Block until every copy to host memory issued so far is done, before the host reads what
    a graph returned copied out (gradients of parameters kept in host memory, which the host's
    optimizer steps)."""
    for stream in _SIDE_STREAMS.values():
        stream.synchronize()


OFFLOAD_OPS = (torch.ops.autopar.offload.default,)
"""Ops whose results live in host memory, not on the device."""
RELOAD_OP = torch.ops.autopar.reload.default
