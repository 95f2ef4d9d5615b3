"""The core values every layer shares: the mesh and its links, placements, strategies, the plan's
data and its table, the names that kinds, phases and choices take (:mod:`autopar.core.kinds`),
errors, and the conventions of captured graphs (module segments, the ops that copy to and from
host memory). Nothing here imports another part of autopar."""
