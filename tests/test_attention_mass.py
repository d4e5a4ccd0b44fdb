"""The shared-stream share of a causal encoder-decoder's attention (kvgraft.eval.attention_mass)."""

from __future__ import annotations

import pytest
import torch

from kvgraft.eval.attention_mass import shared_attention_share
from kvgraft.model.presets import get_preset
from kvgraft.model.transformer import Transformer


def _ced(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(get_preset("ced-tiny")).eval()  # window 8, kv_source layers 1, 2


def test_share_is_zero_inside_the_window_and_positive_beyond_and_changes_nothing():
    model = _ced()
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(1))
    before = model(ids)
    window = model.config.sliding_window
    early = shared_attention_share(model, [(ids[0].tolist(), 0, window - 1)])  # no shared entry visible yet
    late = shared_attention_share(model, [(ids[0].tolist(), 32, 47)])
    assert early.per_layer[0] is None  # layer 0 reads only its window
    assert all(v == 0.0 for v in early.per_layer[1:])
    assert all(0.0 < v < 1.0 for v in late.per_layer[1:]) and late.positions == 16
    assert torch.equal(model(ids), before)  # the measurement leaves the model as it was
    assert "attend" not in model.layers[1].self_attn.__dict__


def test_a_stream_made_to_dominate_takes_the_mass():
    """Scaling the shared keys' latent read-out up makes the shared scores dominate: the share rises toward 1."""
    model = _ced()
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(2))
    base = shared_attention_share(model, [(ids[0].tolist(), 40, 47)]).mean
    with torch.no_grad():
        for b in model.layers[1:]:
            b.self_attn.kv_b_proj.weight.mul_(50)
    assert shared_attention_share(model, [(ids[0].tolist(), 40, 47)]).mean > max(0.5, base)


def test_refuses_a_model_without_shared_stream_and_bad_positions():
    torch.manual_seed(0)
    llama = Transformer(get_preset("llama-tiny")).eval()
    with pytest.raises(ValueError, match="causal encoder-decoder"):
        shared_attention_share(llama, [([1, 2, 3], 0, 2)])
    with pytest.raises(ValueError, match="positions 2..5"):
        shared_attention_share(_ced(), [([1, 2, 3], 2, 5)])
