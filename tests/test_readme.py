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
    # the ranks print at once, so their lines may interleave
    reports = dict(re.findall(r"rank (\d): (norm .*? on this rank)", done.stdout))
    assert sorted(reports) == ["0", "1", "2", "3"], done.stdout
    assert len(set(reports.values())) == 1, reports  # every rank: the same norm, loss and counts
    assert (tmp_path / "checkpoint").is_dir()
