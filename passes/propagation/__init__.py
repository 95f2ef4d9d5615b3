"""Propagation, beside the rules (:mod:`autopar.passes.rules`) in the same layer: the strategies of
every node, the moves between layouts and what they cost on a link, gradient buckets and the
local op each rank runs on its piece. Reads the core, analysis and the rules."""
