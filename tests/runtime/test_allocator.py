"""Freed host memory kept for reuse: a step's large tensors stop faulting in fresh pages."""

import platform
import subprocess
import sys

import pytest

# Each step makes three 4 MiB tensors and frees them. With glibc's initial mmap threshold of
# 128 KiB pinned (as mallopt does; by default glibc moves it, and whether a step faults then
# depends on the heap's layout), each tensor is mapped afresh and faults its 1 Ki pages in
# every step; keep_freed_memory() must undo that.
_STEPS = """
import ctypes, ctypes.util, resource, sys, torch
from autopar.runtime.allocator import keep_freed_memory
assert ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
if sys.argv[1] == "keep":
    assert keep_freed_memory()
x = torch.randn(8, 1024)
def step():
    pieces = [x.t() @ x for _ in range(3)]
    return sum(p.sum() for p in pieces)
for _ in range(10):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_tensors_made_and_freed_each_step_fault_their_pages_in_only_without_keeping_freed_memory():
    def faults(mode: str) -> int:
        return int(
            subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True).stdout
        )

    assert faults("mmap") > 40 * 3 * 1000  # every step, every tensor: 1 Ki pages of 4 KiB
    assert faults("keep") < 3 * 1024  # less than one step's tensors, once
