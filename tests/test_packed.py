"""oneDNN-packed linear layers (kvgraft.model.packed): the same function as nn.Linear up to accumulation order,
the same parameters and state dict, exact F.linear whenever a gradient is needed, never stale after the weight
changes; the engine's tokens with and without packing on the shipped Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvgraft.hf import load_pretrained
from kvgraft.model.packed import (
    PackedLinear,
    pack_linears,
    packed_bytes,
    packed_dtypes,
    packing_available,
    unpack_linears,
)
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

MODELS = Path(__file__).resolve().parents[1] / "models"
pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear packing")


def _net(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 40, bias=False)).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_equals_linear_up_to_rounding(dtype: torch.dtype, tol: float) -> None:
    net = _net(dtype)
    x = torch.randn(3, 7, 48).to(dtype)
    with torch.no_grad():
        want = net(x)
        state = {k: v.clone() for k, v in net.state_dict().items()}
        params = list(net.parameters())
        assert pack_linears(net) == 2
        assert all(type(m) is PackedLinear for m in (net[0], net[2]))
        got = net(x)
    assert list(net.parameters()) == params and net.state_dict().keys() == state.keys()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if dtype in packed_dtypes():
        assert packed_bytes(net) == sum(m.weight.numel() * m.weight.element_size() for m in (net[0], net[2]))
        assert net[0].packed and net[2].packed
    else:  # bfloat16 on a CPU oneDNN cannot pack it for (AVX2 only): F.linear, the same numbers, nothing packed
        assert packed_bytes(net) == 0 and not net[0].packed
        assert torch.equal(got, want)


def test_gradient_path_is_exact_linear() -> None:
    net = _net()
    ref = _net()
    pack_linears(net)
    x = torch.randn(5, 48, requires_grad=True)
    y = net(x)
    assert torch.equal(y, ref(x))  # grad enabled: F.linear, bit for bit
    y.square().sum().backward()
    assert net[0].weight.grad is not None and x.grad is not None


def test_repacks_when_the_weight_changes() -> None:
    net = _net()
    pack_linears(net)
    x = torch.randn(4, 48)
    with torch.no_grad():
        before = net(x)
        net[0].weight.mul_(2.0)  # in place: the version moves
        in_place = net(x)
        net[2].weight = nn.Parameter(torch.zeros(40, 96))  # replaced: the storage moves
        replaced = net(x)
        plain = F.linear(F.silu(F.linear(x, net[0].weight, net[0].bias)), torch.zeros(40, 96))
    assert not torch.allclose(in_place, before)
    torch.testing.assert_close(replaced, plain)


def test_unpack_restores_plain_linear() -> None:
    net = _net()
    pack_linears(net)
    assert unpack_linears(net) == 2
    assert all(type(m) is nn.Linear for m in (net[0], net[2])) and packed_bytes(net) == 0


def test_a_packed_model_deep_copies_and_packs_again() -> None:
    import copy

    net = _net()
    pack_linears(net)
    twin = copy.deepcopy(net)
    assert type(twin[0]) is PackedLinear and not twin[0].packed
    x = torch.randn(2, 48)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), net(x))
    assert twin[0].packed


def test_engine_tokens_equal_with_and_without_packing() -> None:
    params = SamplingParams(max_new_tokens=12)
    prompts = [[1, 5, 9, 200, 31], list(range(3, 40)), [7] * 70]
    outs = []
    for packed in (False, True):
        model = load_pretrained(MODELS / "kvgraft-llama-8m").eval()
        engine = Engine(model, EngineOptions(max_seqs=4, max_seq_len=128, packed_linears=packed))
        assert engine.packed_linears == (0 if not packed else len([m for m in model.modules() if isinstance(m, nn.Linear)]))
        ids = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        outs.append([engine.requests[i].output for i in ids])
    assert outs[0] == outs[1] and all(len(o) == 12 for o in outs[0])


def test_engine_refuses_bad_packed_linears() -> None:
    model = load_pretrained(MODELS / "kvgraft-llama-8m")
    with pytest.raises(ValueError, match="packed_linears"):
        Engine(model, EngineOptions(max_seqs=2, max_seq_len=64, packed_linears="yes"))  # type: ignore[arg-type]


def test_linears_fuses_packed_layers_and_follows_weight_changes() -> None:
    from kvgraft.model.packed import linears

    torch.manual_seed(1)
    mods = [nn.Linear(32, 24), nn.Linear(32, 8, bias=False), nn.Linear(32, 16)]
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = [m(x) for m in mods]
        net = nn.ModuleList(mods)
        pack_linears(net)
        got = linears(x, *mods)
        assert [tuple(g.shape) for g in got] == [(2, 5, 24), (2, 5, 8), (2, 5, 16)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert not any(m.packed for m in mods)  # fused: the single copies were dropped
        assert packed_bytes(net) == sum(m.weight.numel() * 4 for m in mods)
        mods[1].weight.add_(1.0)
        torch.testing.assert_close(linears(x, *mods)[1], F.linear(x, mods[1].weight), rtol=1e-5, atol=1e-5)
    y = linears(x.requires_grad_(), *mods)  # a gradient is needed: each module on its own, exact
    assert all(torch.equal(a, m(x)) for a, m in zip(y, mods))


def test_adjacent_finds_the_buffer_behind_split_views_only() -> None:
    from kvgraft.model.packed import adjacent

    y = torch.randn(2, 5, 40)
    q, k, v = torch.split(y, [24, 8, 8], dim=-1)
    joined = adjacent(q, k, v)
    assert joined is not None and torch.equal(joined, y) and joined.data_ptr() == y.data_ptr()
    assert torch.equal(adjacent(k, v), y[..., 24:])
    assert adjacent(q, v) is None  # not neighbours
    assert adjacent(q, k.clone(), v) is None  # another buffer
    assert adjacent(y[:, :3, :24], y[:, :3, 24:32]) is not None and adjacent(y[:, :3, :24], y[:, 1:4, 24:32]) is None
