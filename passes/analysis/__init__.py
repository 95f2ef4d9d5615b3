"""Graph analysis: capturing the joint training graph, the module path of each op, and the
liveness of a program's tensors. Reads only :mod:`autopar.core`."""
