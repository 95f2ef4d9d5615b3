"""Compiler passes, in layers that import only downward: ``analysis`` (capture, liveness),
``rules`` and ``propagation``, then above the cost model ``solve`` and ``lower``."""
