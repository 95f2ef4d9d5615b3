"""Freed host memory kept for reuse: a step's large tensors stop faulting in fresh pages."""

import platform
import subprocess
import sys

import pytest

# Each step makes three 4 MiB tensors and frees them: by default glibc gives the freed top of its
# heap back to the kernel (more than twice the mmap threshold, which has risen to 4 MiB, is free)
# and the next step faults the pages in again.
_STEPS = """
import resource, sys, torch
from autopar.runtime.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
x = torch.randn(8, 1024)
def step():
    pieces = [x.t() @ x for _ in range(3)]
    return sum(p.sum() for p in pieces)
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_tensors_made_and_freed_each_step_fault_their_pages_in_only_without_keeping_freed_memory():
    def faults(mode: str) -> int:
        return int(subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True).stdout)

    assert faults("default") > 1024  # at least one 4 MiB tensor's 1 Ki pages of 4 KiB faulted in again
    assert faults("keep") < 64
