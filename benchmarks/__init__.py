"""Benchmarks of autopar: each prints tables and writes JSON under ``benchmarks/results/``."""

import json
import os
import platform
import time
from pathlib import Path


def write_results(path: Path, **fields) -> None:
    """Write ``fields`` as JSON to ``path`` with the machine and date they were measured on."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    path.write_text(json.dumps({**fields, "machine": machine, "date": time.strftime("%Y-%m-%d")}, indent=1))
    print(f"\nwrote {path}")
