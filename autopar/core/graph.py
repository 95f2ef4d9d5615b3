"""What every layer reads of a captured graph: the segment an op belongs to by its module path,
its layer of a stack (``blocks.3``) or its top-level module; and the nodes a value is computed
from."""

import re

from torch import fx

_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def segment_of(module: str) -> str:
    """The segment of an op from its module path: its layer (``blocks.3``) when it is inside a
    stack, else its top-level module."""
    match = _LAYER.match(module)
    return match.group(1) if match else module.split(".")[0]


def is_layer(segment: str) -> bool:
    return bool(_LAYER.match(segment))


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    found, todo = {node}, [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in found:
                found.add(a)
                todo.append(a)
    return found
