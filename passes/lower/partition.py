"""Split a per-rank joint graph into a forward graph and a backward graph.

Nodes that depend on a tangent (the gradient flowing into the step's outputs), and those the
rewriter marks for the backward (the captured backward's ops, and the moves and recomputations
of forward values for it), form the backward; the rest run in the forward. Forward
values the backward reads are returned by the forward graph as saved tensors and taken by the
backward graph as inputs, as AOT autograd does.
"""

from dataclasses import dataclass

from autopar.passes.analysis.capture import backward_nodes
from autopar.passes.lower.rewrite import IN_BACKWARD, PART, RECOMPUTED
from torch import fx
from torch.fx.graph import _BoxedCodeGen
from torch.fx.passes.split_module import split_module

from autopar.core.offload_ops import RELOAD_OP


@dataclass(frozen=True, slots=True)
class Partitioned:
    forward: fx.GraphModule
    """``(*primals) -> (*outputs, *saved)``."""
    backward: fx.GraphModule
    """``(*saved, *tangents) -> (*grads)``; :func:`boxed` makes it free each saved tensor
    after its last read."""
    num_outputs: int
    num_saved: int


def partition(joint: fx.GraphModule, is_tangent: list[bool], output_is_grad: list[bool | None]) -> Partitioned:
    """``is_tangent`` marks placeholders; ``output_is_grad`` marks each joint output as a
    forward result (False), a gradient (True) or unused (None)."""
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    tangents = {n for n, t in zip(placeholders, is_tangent) if t}
    marked = {n for n in joint.graph.nodes if n.meta.get("custom", {}).get("autopar") == IN_BACKWARD["autopar"]}
    backward = backward_nodes(joint.graph, tangents | marked)
    outputs = list(joint.graph.output_node().args[0])
    fwd_outputs = [o for o, g in zip(outputs, output_is_grad) if g is False]
    grads = [o for o, g in zip(outputs, output_is_grad) if g]
    saved: list[fx.Node] = []
    for node in joint.graph.nodes:
        if node in backward or node.op == "output":
            continue
        if any(u in backward for u in node.users) or node in grads:
            saved.append(node)

    fw = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in joint.graph.nodes:
        if node.op == "output" or node in backward:
            continue
        env[node] = fw.node_copy(node, lambda n: env[n])
    fw.output(tuple(env[o] for o in fwd_outputs) + tuple(env[s] for s in saved))

    bw = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for s in saved:
        benv[s] = bw.placeholder(f"saved_{s.name}")
        benv[s].meta = dict(s.meta)
    for t in (n for n in placeholders if n in tangents):
        benv[t] = bw.node_copy(t)
    for node in joint.graph.nodes:
        if node in backward and node.op != "placeholder":
            benv[node] = bw.node_copy(node, lambda n: benv[n])
    bw.output(tuple(benv[g] if g is not None else None for g in grads))
    for graph in (fw, bw):  # before the modules are made: each compiles its graph's code once, when made
        graph.eliminate_dead_code()
    forward, backward_gm = fx.GraphModule(joint, fw), fx.GraphModule(joint, bw)
    for gm in (forward, backward_gm):
        gm.graph.lint()
    return Partitioned(forward, backward_gm, len(fwd_outputs), len(saved))


def layer_by_layer(backward: fx.GraphModule) -> fx.GraphModule | None:
    """``backward`` split into one graph per layer, in the order the backward reaches the
    layers (each node's ``PART``), called in turn by the graph returned; ``None`` where the
    backward neither recomputes nor copies back from the host, or has one layer.

    A compiler free to order a whole backward graph (Inductor fuses and reorders across it)
    may run a layer's recomputation or its copy back long before the layer's backward, holding
    the values all the while; split this way, each layer's values are made in its own graph,
    as the plan's memory counts them."""
    nodes = [n for n in backward.graph.nodes if n.op == "call_function"]
    refilled = any(RECOMPUTED.items() <= n.meta.get("custom", {}).items() or n.target is RELOAD_OP for n in nodes)
    parts, part = {}, 0
    for n in nodes:
        part = max(part, n.meta.get("custom", {}).get(PART, part))
        parts[n] = part
    if not refilled or len(set(parts.values())) < 2:
        return None
    first = min(parts.values())
    return split_module(backward, backward, lambda n: parts.get(n, first), keep_original_order=True)


def boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` taking its inputs as one list, which it empties, and dropping each input after
    its last read, as AOT autograd's backward graphs do: a saved activation the caller no
    longer holds is then freed as soon as the backward is done with it, not at its end."""
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm
