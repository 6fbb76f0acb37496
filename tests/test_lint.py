"""The code passes ruff (pycodestyle, pyflakes, import order; 120 columns) and pyright (basic mode) as
pyproject.toml configures them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_pyright_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "pyright", "--project", str(ROOT)], capture_output=True, text=True,
                          check=False, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr
