"""What every layer reads of a captured graph's module paths: the segment an op belongs to,
its layer of a stack (``blocks.3``) or its top-level module."""

import re

_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def segment_of(module: str) -> str:
    """The segment of an op from its module path: its layer (``blocks.3``) when it is inside a
    stack, else its top-level module."""
    match = _LAYER.match(module)
    return match.group(1) if match else module.split(".")[0]


def is_layer(segment: str) -> bool:
    return bool(_LAYER.match(segment))
