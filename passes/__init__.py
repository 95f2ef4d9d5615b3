"""Compiler passes: capture, sharding rules, propagation, the solver and the rewriter."""
