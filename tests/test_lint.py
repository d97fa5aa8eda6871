"""The repository passes `ruff check` with the configuration in pyproject.toml.

ruff is part of the `test` extra, so README's test command installs it; a missing ruff fails
here rather than skipping, so that lint cannot silently stop being checked.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert "No module named ruff" not in done.stderr, "ruff is missing: pip install -e '.[test]'"
    assert done.returncode == 0, f"ruff check found problems:\n{done.stdout[-6000:]}{done.stderr[-2000:]}"
