"""The vLLM parity tests (docs/vllm.md): marked `vllm`, run by `make test-vllm` in the separate .venv-vllm.

`make test` deselects them (pyproject addopts: -m 'not slow and not vllm') and never imports vllm; run in an
environment without vLLM (`pytest -m vllm tests/vllm`), every test here is skipped with the reason.
This folder has no __init__.py on purpose: as a package it would be importable as `vllm` and shadow vLLM.
"""

from __future__ import annotations

import os

import pytest
from engines import VLLM_ENV, vllm_available

for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)

_available: tuple[bool, str] | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Skip (with the reason) when vllm does not import here, before any fixture (an engine) is set up;
    vllm is imported on first use only."""
    global _available
    if item.get_closest_marker("vllm") is None:
        return
    if _available is None:
        _available = vllm_available()
    ok, why = _available
    if not ok:
        pytest.skip(
            f"vllm is not importable in this environment ({why}): build it with `make vllm-env`, run with `make test-vllm`"
        )
