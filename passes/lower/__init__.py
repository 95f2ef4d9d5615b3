"""Lowering a plan to per-rank programs: the rewritten joint graph with its collectives,
recomputation and offload, partitioned into forward and backward, and the liveness of that
program. Reads the plan and the layers below; nothing here runs on a process group."""
