"""Shared test configuration: markers `slow` (real model) and `gpu` (needs CUDA)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _run_outside_the_source_tree(tmp_path, monkeypatch) -> None:
    """Tests (and the Python subprocesses they start) run from an empty directory, so
    `import jacobi_ext` resolves to the installed package (with its compiled _C), never to the
    source folder of a checkout that was installed non-editable."""
    monkeypatch.chdir(tmp_path)
