"""Tests use tiny models, which run fastest single-threaded (and do not fight a second process for cores)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
