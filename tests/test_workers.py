"""`pytest -n auto` (pyproject's addopts) starts one worker a core, as many as the available memory holds."""

from __future__ import annotations

import pytest

from tests import conftest


@pytest.mark.parametrize("cores, available_gib, workers",
                         [(2, 24, 2), (16, 24, 6), (16, 3, 1), (1, 64, 1), (4, None, 4)])
def test_workers_are_cores_capped_by_memory(monkeypatch, cores, available_gib, workers):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(conftest, "usable_threads", lambda: cores)
    monkeypatch.setattr(conftest, "available_memory", lambda: None if available_gib is None else available_gib << 30)
    assert conftest.pytest_xdist_auto_num_workers(None) == workers


def test_the_variable_sets_the_number(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert conftest.pytest_xdist_auto_num_workers(None) == 3
