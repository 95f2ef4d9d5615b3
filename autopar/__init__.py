"""autopar: automatic parallelization of PyTorch training on a device mesh."""
