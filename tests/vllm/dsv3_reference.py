"""DeepSeek-V3 attention written out by hand in plain torch, from config.json + safetensors: the third opinion
that decides which engine is right when vLLM and transformers disagree (docs/vllm.md).

It follows DeepSeek's own definition (the reference inference code published with DeepSeek-V3): RoPE rotates
*adjacent* pairs (x[2j], x[2j+1]) of q_pe / k_pe by position * theta^(-2j / qk_rope_head_dim); the latent
norm ``kv_a_layernorm`` (and ``q_a_layernorm``) has eps 1e-6; softmax scale (qk_nope + qk_rope)^-0.5; causal
attention of every query head over the one shared k_pe and the per-head keys/values expanded from the latent.
Dense MLPs only (first_k_dense_replace >= num_hidden_layers), default RoPE only: what the tests here build.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_adjacent(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of x ([T, ..., d]) by positions[t] * theta^(-2j/d)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.double()[:, None] * inv[None]
    ang = ang.view(ang.shape[0], *([1] * (x.dim() - 2)), d // 2)
    c, s = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


class ReferenceDeepseekV3:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.w = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            self.w.update({k: v.float() for k, v in load_file(str(f)).items()})
        c = self.cfg
        if c.get("first_k_dense_replace", 0) < c["num_hidden_layers"]:
            raise NotImplementedError("the reference has dense MLPs only")
        rope = c.get("rope_parameters") or {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError("the reference has default RoPE only")
        self.theta = float(rope["rope_theta"])

    @torch.no_grad()
    def forward(self, ids, capture: dict | None = None) -> torch.Tensor:
        """Logits [T, vocab] for one sequence; with ``capture`` (a dict), per layer i: capture[i] = {"q_pe",
        "k_pe" (after RoPE, adjacent-pair layout as in the checkpoint), "attn" (o_proj output), "out" (layer
        output)}."""
        c, w = self.cfg, self.w
        ids = torch.as_tensor(ids, dtype=torch.long)
        T = ids.numel()
        pos = torch.arange(T)
        H, dn, dr, dv, r = (
            c["num_attention_heads"],
            c["qk_nope_head_dim"],
            c["qk_rope_head_dim"],
            c["v_head_dim"],
            c["kv_lora_rank"],
        )
        eps = c["rms_norm_eps"]
        scale = (dn + dr) ** -0.5
        h = w["model.embed_tokens.weight"][ids]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = _rms(h, w[p + "input_layernorm.weight"], eps)
            a = p + "self_attn."
            if c.get("q_lora_rank"):
                q = _rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6) @ w[a + "q_b_proj.weight"].T
            else:
                q = x @ w[a + "q_proj.weight"].T
            q = q.view(T, H, dn + dr)
            q_nope, q_pe = q[..., :dn], rope_adjacent(q[..., dn:], pos, self.theta)
            kv = x @ w[a + "kv_a_proj_with_mqa.weight"].T
            latent = _rms(kv[:, :r], w[a + "kv_a_layernorm.weight"], 1e-6)
            k_pe = rope_adjacent(kv[:, r:], pos, self.theta)
            kvb = (latent @ w[a + "kv_b_proj.weight"].T).view(T, H, dn + dv)
            k_nope, v = kvb[..., :dn], kvb[..., dn:]
            scores = (torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_pe, k_pe)) * scale
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, H * dv)
            attn = o @ w[a + "o_proj.weight"].T
            h = h + attn
            y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            m = p + "mlp."
            y = (torch.nn.functional.silu(y @ w[m + "gate_proj.weight"].T) * (y @ w[m + "up_proj.weight"].T)) @ w[
                m + "down_proj.weight"
            ].T
            h = h + y
            if capture is not None:
                capture[i] = {"q_pe": q_pe.clone(), "k_pe": k_pe.clone(), "attn": attn.clone(), "out": h.clone()}
        h = _rms(h, w["model.norm.weight"], eps)
        return h @ w["lm_head.weight"].T
