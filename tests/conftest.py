"""Tests use tiny models, which run fastest single-threaded (and do not fight a second process for cores)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def graft_model():
    """A factory of tiny random Llama-family models for the MLA graft's tests: non-zero biases (when asked),
    norm weights away from one, and q/k weights x4 so attention is sharp (a distance profile far from
    uniform, RoPE pairs that matter)."""
    from kvgraft.model import ModelConfig, Transformer

    def make(
        num_kv_heads: int = 2,
        bias: bool = True,
        window: int | None = None,
        qk_norm: bool = False,
        layers: int = 2,
        tie: bool = False,
        seed: int = 0,
    ) -> Transformer:
        cfg = ModelConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_layers=layers,
            num_heads=4,
            num_kv_heads=num_kv_heads,
            head_dim=16,
            max_position_embeddings=64,
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=window,
            qk_norm=qk_norm,
            tie_word_embeddings=tie,
        )
        model = Transformer(cfg).eval()
        model.init_weights(seed)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "bias" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                elif "norm" in name:
                    p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
                elif "q_proj" in name or "k_proj" in name:
                    p.mul_(4)
        return model

    return make
