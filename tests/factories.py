"""Model factories shared by the tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvgraft.model.config import ModelConfig
from kvgraft.model.transformer import Transformer
from kvgraft.train.loop import bf16_emulated

# Training tests on a CPU without bfloat16 matrix instructions: bf16 autocast runs emulated there, ~35x slower than
# fp32 for a linear layer (kvgraft.train.loop.bf16_emulated), so such a test's bf16 run is marked slow (`make
# test-slow`, which CI runs) and a test whose subject is not the precision trains in fp32 (FAST_PRECISION).
BF16_EMULATED = bf16_emulated("cpu")
FAST_PRECISION = "fp32" if BF16_EMULATED else "bf16"
BF16 = pytest.param("bf16", marks=pytest.mark.slow) if BF16_EMULATED else "bf16"


def sharp_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A random kvgraft model whose matrices are scaled 4x from the init, so its next-token distributions are
    peaked (greedy tokens are not near-ties and differences show), in eval mode."""
    torch.manual_seed(seed)
    m = Transformer(cfg)
    m.init_weights(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return m.eval()


@contextlib.contextmanager
def live_uvicorn(app, *, start_timeout: float = 60.0, **config) -> Iterator[int]:
    """Serve ``app`` with uvicorn on a free loopback port in a daemon thread; yields the port once started
    (failing the test if it does not start within ``start_timeout`` s) and stops it on exit. ``config``:
    further ``uvicorn.Config`` arguments (default ``log_level="warning"``)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    userver = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **{"log_level": "warning", **config}))
    thread = threading.Thread(target=userver.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not userver.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        userver.should_exit = True
        thread.join(15)
