"""The solver: the integer program over strategies, recomputation, offload and memory, solved
by HiGHS, with standard layouts and layer classes, turned into a plan. Reads the layers below
it, down to the cost model."""
