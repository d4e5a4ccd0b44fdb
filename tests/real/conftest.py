"""Shared by the real-model tests: the fetched SmolLM2-135M-Instruct, or a skip naming the command to fetch it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgraft.reference import fetch_command, fetched_model_dir

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    path = fetched_model_dir(NAME)
    if path is None:
        pytest.skip(f"{NAME} is not fetched: run `make real-model` ({fetch_command(NAME)})")
    return path
