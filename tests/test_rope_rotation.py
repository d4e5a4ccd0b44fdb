"""The per-frequency head mix of the MLA graft's RoPE decoupling: real (orthogonal) or complex (unitary).

A frequency-f pair of KV head j is a complex number z_j that RoPE multiplies by a phase; any complex mix of the
heads commutes with it. The complex rotation keeps, as each kept rotated head, the best rank-1 complex fit of
the heads' pair (a per-head phase and weight, folded into the queries). Exact wherever the real one is, never
less key energy in the kept head, and the same as the real one for one KV head.
"""

from __future__ import annotations

import pytest
import torch

from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.graft.mla_math import head_rotations

CAL = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(1))
IDS = torch.randint(0, 96, (2, 28), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("case", ["GQA2_bias", "MHA", "qwen3"])
def test_complex_rotation_is_exact_at_full_budget(case, graft_model):
    """Every rotated pair kept, latent = KV width: exact, as with the real rotation (queries, biases, the
    Qwen3 per-head query map all take the complex coefficients)."""
    k = 4 if case == "MHA" else 2
    model = graft_model(k, bias=case == "GQA2_bias", qk_norm=case == "qwen3")
    g = GraftConfig(
        kv_lora_rank=2 * k * 16, qk_rope_head_dim=k * 16, objective="attention", rope_selection="norm", rope_rotation="complex"
    )
    new = graft_mla(model, g, CAL, progress=False).eval()
    if case == "qwen3":  # the key norm is linearised (not exact by construction): compare with the real graft
        real = graft_mla(model, GraftConfig(**{**g.__dict__, "rope_rotation": "real"}), CAL, progress=False).eval()
        with torch.no_grad():
            torch.testing.assert_close(new(IDS), real(IDS), atol=1e-4, rtol=0)
        return
    with torch.no_grad():
        torch.testing.assert_close(new(IDS), model(IDS), atol=1e-4, rtol=0)


def test_complex_rotation_keeps_at_least_the_real_energy():
    gen = torch.Generator().manual_seed(0)
    K, d, h = 4, 16, 48
    w_k = torch.randn(K * d, h, dtype=torch.float64, generator=gen)
    a = torch.randn(h, h, dtype=torch.float64, generator=gen)
    C = a @ a.T / h
    real, cplx = head_rotations(w_k, C, K, d), head_rotations(w_k, C, K, d, rotation="complex")
    assert cplx.dtype == torch.complex128
    eye = torch.eye(K, dtype=torch.complex128)
    torch.testing.assert_close(cplx @ cplx.mH, eye.expand(d // 2, K, K))
    gains = []
    for f in range(d // 2):
        rows = [j * d + f for j in range(K)], [j * d + f + d // 2 for j in range(K)]
        A, B = w_k[rows[0]], w_k[rows[1]]
        z = torch.complex(A, B)  # (K, h): z_j . x
        G = z @ C.to(torch.complex128) @ z.mH  # E[z_j conj(z_j')]; the energy of u is E|u . z|^2 = u G u^H
        e_real = float((real[f, 0].to(torch.complex128) @ G @ real[f, 0].to(torch.complex128).conj()).real)
        e_cplx = float((cplx[f, 0] @ G @ cplx[f, 0].conj()).real)
        assert e_cplx >= e_real * (1 - 1e-12)
        gains.append(e_cplx / e_real)
    assert max(gains) > 1.05  # random heads: the per-head phase buys energy somewhere


def test_one_kv_head_complex_equals_real(graft_model):
    model = graft_model(1, bias=False)
    outs = [
        graft_mla(
            model, GraftConfig(kv_lora_rank=12, qk_rope_head_dim=8, rope_selection="prefix", rope_rotation=r), CAL, progress=False
        ).eval()
        for r in ("real", "complex")
    ]
    with torch.no_grad():
        torch.testing.assert_close(outs[1](IDS), outs[0](IDS), atol=1e-5, rtol=0)


def test_bad_rotation_is_named():
    with pytest.raises(ValueError, match="rope_rotation 'quaternion'"):
        GraftConfig(kv_lora_rank=16, qk_rope_head_dim=8, rope_rotation="quaternion")
