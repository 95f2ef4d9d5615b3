"""The README's training-loop script runs as it stands on 4 ranks."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def _training_loop_script() -> str:
    section = README.read_text().split("### Training loop", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_training_loop_of_the_readme_runs_on_four_ranks(tmp_path):
    (tmp_path / "train.py").write_text(_training_loop_script())
    done = subprocess.run(
        [sys.executable, "-m", "autopar.cli", "run", "-n", "4", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 4 and len(set(lines)) == 1, lines  # every rank: the same norm, loss and counts
    assert (tmp_path / "checkpoint").is_dir()
