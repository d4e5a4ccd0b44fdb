"""Model factories shared by the tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

from kvgraft.model.config import ModelConfig
from kvgraft.model.transformer import Transformer


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
