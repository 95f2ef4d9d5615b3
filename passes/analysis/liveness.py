"""Per-device peak memory by liveness, from the per-rank program itself.

The solver budgets memory with a sum (parameters, gradients, optimizer state, kept and
recomputed activations, the largest temporary). The program a rank runs is known exactly once a
plan exists: this module walks its forward and backward graphs (traced on fake tensors) as the
runtime runs them, a tensor alive from the op that makes it to the last op that reads it or
any view of it (a collective's input until the collective is waited for), a tensor the forward
saves until the last op of the backward that reads it (the runtime's backward frees them as it
goes, :func:`autopar.passes.lower.partition.boxed`), gradients until the optimizer has stepped.
Storages are counted once however many views look into them; copies offloaded to host memory
are not device memory, nor is optimizer state stepped on the host.
"""

from dataclasses import dataclass

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.core.kinds import GraphInputKind
from autopar.core.offload_ops import OFFLOAD_OPS

_ALIASES = {torch.ops._c10d_functional.wait_tensor.default}
"""Ops whose result is their input (a collective's result is the buffer it was launched into)."""

ADAM_SLOTS = 2
"""Optimizer states per parameter that memory is planned for: Adam's two moments."""


@dataclass(frozen=True, slots=True)
class Liveness:
    """Peak bytes alive per device in each phase of a training step."""

    forward_bytes: int
    backward_bytes: int
    optimizer_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_bytes, self.backward_bytes, self.optimizer_bytes)


def step_liveness(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    kinds: list[GraphInputKind],
    *,
    optimizer_slots: int = ADAM_SLOTS,
    on_host: list[bool] | None = None,
    host_inputs: list[bool] | None = None,
) -> Liveness:
    """The peaks of one step of a partitioned per-rank program (see
    :func:`autopar.passes.lower.partition.partition`). ``kinds`` says what each input of the forward
    graph is: ``"param"``, ``"buffer"`` or ``"input"`` (a piece of the batch, alive for the
    step). Each parameter has ``optimizer_slots`` optimizer states (2 for Adam), alive
    throughout, unless ``on_host`` marks it stepped on the host; the optimizer step itself
    holds about two of the largest parameter stepped on the device. Inputs that
    ``host_inputs`` marks (parameters living in host memory) are left out."""
    placeholders = [node for node in forward.graph.nodes if node.op == "placeholder"]
    host_inputs = host_inputs or [False] * len(kinds)
    sizes = [
        0 if host else sum(n for _, n in _keys(node.meta.get("val"))) for node, host in zip(placeholders, host_inputs)
    ]
    on_host = on_host or [False] * len(kinds)
    params = [n for n, kind, host in zip(sizes, kinds, on_host) if kind == "param" and not host]
    resident = sum(sizes) + optimizer_slots * sum(params)
    forward_peak, saved = _run(forward)
    backward_peak, grads = _run(backward, saved)
    return Liveness(
        forward_bytes=resident + forward_peak,
        backward_bytes=resident + backward_peak,
        optimizer_bytes=resident + sum(grads.values()) + 2 * max(params, default=0),
    )


def _keys(value) -> list:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [
        (StorageWeakRef(v.untyped_storage()).cdata, v.untyped_storage().nbytes())
        for v in values
        if isinstance(v, torch.Tensor)
    ]


@dataclass(frozen=True, slots=True)
class Lifetimes:
    """Where each storage a graph touches is made and last read, in the graph's node order."""

    nodes: list[fx.Node]
    storage: dict[fx.Node, list]
    """Per node, the ``(storage key, bytes)`` of what it returns."""
    last: dict
    """Per storage key, the index of the last node that reads it (or the node that makes it)."""
    external: set
    """The graph's inputs' storages, which it does not own."""
    outputs: set
    """The storages the graph returns, which outlive it."""
    collective: set
    """The storages collectives read or write."""

    def freed_after(self, owned=frozenset()) -> dict[int, list]:
        """Per node index, the storages the graph owns (with the inputs' storages in
        ``owned``) that are dead once that node has run."""
        frees: dict[int, list] = {}
        for key, i in self.last.items():
            if key not in self.outputs and (key not in self.external or key in owned):
                frees.setdefault(i, []).append(key)
        return frees


def lifetimes(gm: fx.GraphModule) -> Lifetimes:
    """The storages of ``gm``'s values (traced on fake tensors) and their last readers: a
    tensor is read by every op that reads it or any view of it, and a collective's input
    until the collective is waited for."""
    nodes = list(gm.graph.nodes)
    storage: dict[fx.Node, list] = {}
    external = set()
    same: dict = {}  # the storage a wait's traced result has -> the collective's, which it is
    for node in nodes:
        if node.op == "placeholder":
            storage[node] = _keys(node.meta.get("val"))
            external.update(k for k, _ in storage[node])
        elif node.op == "call_function" and node.target in _ALIASES:
            storage[node] = storage.get(node.args[0], [])
            same.update((k, s) for (k, _), (s, _) in zip(_keys(node.meta.get("val")), storage[node]))
        elif node.op == "call_function" and node.target in OFFLOAD_OPS:
            storage[node] = []
        elif node.op == "call_function":
            storage[node] = [(same.get(k, k), n) for k, n in _keys(node.meta.get("val"))]
    last: dict = {}
    collective = set()
    for i, node in enumerate(nodes):
        read = node.all_input_nodes
        if node.op == "call_function" and node.target in _ALIASES:
            read = [*read, *(a for r in read for a in r.all_input_nodes)]
            collective.update(key for r in read for key, _ in storage.get(r, []))
        for reader in read:
            for key, _ in storage.get(reader, []):
                last[key] = i
        for key, _ in storage.get(node, []):
            last.setdefault(key, i)
    outputs = {key for reader in nodes[-1].all_input_nodes for key, _ in storage.get(reader, [])}
    return Lifetimes(nodes, storage, last, external, outputs, collective)


def _run(gm: fx.GraphModule, held: dict | None = None) -> tuple[int, dict]:
    """The peak bytes the graph allocates while it runs (its inputs aside, but for ``held``:
    the storages, by key and bytes, that the graph is given to free after their last read), and
    the storages of its outputs that it does not take from its inputs, which outlive it."""
    held = held or {}
    life = lifetimes(gm)
    frees = life.freed_after(held.keys())
    live = dict(held)
    size = dict(held)
    total = peak = sum(held.values())
    for i, node in enumerate(life.nodes):
        for key, nbytes in life.storage.get(node, []):
            size[key] = nbytes
            if key not in life.external and key not in live:
                live[key] = nbytes
                total += nbytes
        peak = max(peak, total)
        for key in frees.get(i, ()):
            total -= live.pop(key, 0)
    return peak, {k: size[k] for k in life.outputs if k not in life.external or k in held}


def forward_made(forward: fx.GraphModule) -> frozenset:
    """The storage keys of the forward's results that it makes itself (its saved activations,
    not its inputs or views of them): the backward, given them, may free them."""
    return frozenset(_run(forward)[1])
