"""The vLLM CPU defect behind "one-token prompts agree, longer ones do not" (docs/vllm.md), at the level of
the one op, with no engine, no model and no kvgraft code.

vLLM's MLA layer (vllm/model_executor/layers/mla.py, MultiHeadLatentAttentionWrapper.forward) rotates
``q[..., qk_nope_head_dim:]`` ([T, H, 64], a strided view of q) and ``k_pe.unsqueeze(1)`` ([T, 1, 64], a
strided view of the kv_a_proj_with_mqa output) in place with RotaryEmbedding; on CPU with custom ops
enabled (vLLM's default under enforce_eager) that is ``torch.ops._C.rotary_embedding``, whose CPU kernel
takes the head count from ``query.size(-1) / head_size`` and the token stride from ``query.stride(-2)``,
i.e. it assumes the flat [T, H * head_size] layout. On the 3-D views it rotates the first T 64-wide rows it
finds: token 0's heads 0..T-1 get positions 0..T-1, everything else is left unrotated, and k_pe of tokens
1.. is not rotated at all (the kernel writes into the latent instead).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm

DEFECT = (
    "vLLM CPU rotary_embedding custom op (csrc/cpu/pos_encoding.cpp) reads num_heads from "
    "query.size(-1) and the token stride from query.stride(-2), so the 3-D strided q_pe [T, H, 64] / "
    "k_pe [T, 1, 64] views passed by vllm/model_executor/layers/mla.py are rotated at the wrong rows"
)

T, H, NOPE, ROPE, LATENT = 5, 4, 64, 64, 512


def _rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT, get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            ROPE,
            max_position=256,
            is_neox_style=False,
            dtype=torch.float32,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        )
    _ROPE_DICT.clear()  # do not leave a module built outside an engine in vLLM's process-wide cache
    return rope


def _inputs():
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([3, 4, 5, 6, 7])
    q = torch.randn(T, H, NOPE + ROPE, generator=g)  # q_proj output viewed [T, H, qk_head_dim]
    kv = torch.randn(T, LATENT + ROPE, generator=g)  # kv_a_proj_with_mqa output
    return pos, q, kv


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=DEFECT)
def test_cpu_rotary_op_on_mla_views_matches_native():
    rope = _rope()
    pos, q, kv = _inputs()
    q_ref, k_ref = rope.forward_native(pos, q[..., NOPE:].clone(), kv[:, LATENT:].unsqueeze(1).clone())
    q_op, kv_op = q.clone(), kv.clone()
    rope.forward_cpu(pos, q_op[..., NOPE:], kv_op[:, LATENT:].unsqueeze(1))  # the views mla.py passes
    assert torch.equal(kv_op[:, :LATENT], kv[:, :LATENT]), "the op wrote into the latent"
    torch.testing.assert_close(kv_op[:, LATENT:], k_ref[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(q_op[..., NOPE:], q_ref, rtol=0, atol=1e-5)


def test_cpu_rotary_op_on_flat_inputs_matches_native():
    """The same data as contiguous [T, H * 64] / [T, 64] (the layout Llama-style attention passes): the op is
    right, which is why the Llama control and every non-MLA model agree."""
    rope = _rope()
    pos, q, kv = _inputs()
    q_ref, k_ref = rope.forward_native(pos, q[..., NOPE:].clone(), kv[:, LATENT:].unsqueeze(1).clone())
    q2, k2 = q[..., NOPE:].reshape(T, H * ROPE).clone(), kv[:, LATENT:].clone()
    rope.forward_cpu(pos, q2, k2)
    torch.testing.assert_close(q2.view(T, H, ROPE), q_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(k2, k_ref[:, 0], rtol=0, atol=1e-5)
