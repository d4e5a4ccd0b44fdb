"""Carry a kvgraft adapter to a stock DeepSeek-V3 export of its MLA base (PEFT format in, PEFT format out).

``kvgraft.hf.export_deepseek_v3`` (:mod:`kvgraft.hf.deepseek.export`) rewrites some weights on the way to DeepSeek's layout; a LoRA delta
``B A`` on those weights is rewritten the same way, exactly, so that
``peft.PeftModel.from_pretrained(DeepseekV3ForCausalLM, exported_adapter)`` gives kvgraft's logits:

- ``q_proj``: each head's RoPE rows go from rotate-half to interleaved order and a yarn softmax factor is
  folded in: the same row permutation and factor on ``lora_B``;
- ``kv_a_proj`` (DeepSeek's ``kv_a_proj_with_mqa``): the latent rows are rescaled so stock's latent-norm eps
  acts as kvgraft's, the RoPE-key rows permuted: the same on ``lora_B``, and the module is renamed;
- ``kv_b_proj``, ``o_proj``, the MLP: unchanged.

**MLP adapters cannot be carried (PEFT 0.21):** PEFT rewrites every ``gate_proj``/``up_proj``/``down_proj``
target of a ``deepseek_v3`` model into fused MoE experts' parameters, dense layers too, so an MLP adapter would
be dropped silently: refused here, naming the modules. Attention adapters (q, kv_a, kv_b, o) carry exactly.

Supported for exports whose latent norm is exact: a base with its own latent RMSNorm (``mla_latent_norm``),
or the "pad" export (``target="transformers"``, transformers only) of a base without one (one constant latent
coordinate pins stock's norm): the
adapter's ``kv_a`` rows get a zero row for that coordinate and its ``kv_b`` input a zero column, so its delta
never touches the constant (the pinned rms moves by at most |delta c|^2 / A0^2, A0 >= 1e5 |c|). The
"fit"/"scale" approximations change the latent basis per layer, which the adapter would have to follow:
refused with the reason. So is a ``q_proj`` adapter on a base whose queries have a bias (Qwen2): stock takes
those queries through its low-rank q_a/q_b path, whose input is not the hidden state.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvgraft.adapters.fingerprint import relocate_reference
from kvgraft.adapters.lora import META_FILE, base_fingerprint, check_base, read_meta
from kvgraft.atomic import atomic_dir
from kvgraft.errors import ConfigError
from kvgraft.hf.deepseek.latent import LATENT_NORM_STRATEGIES, STOCK_LATENT_NORM_EPS
from kvgraft.hf.deepseek.rope import stock_rope_parameters
from kvgraft.hf.deepseek.tensors import interleave_perm, query_bias_layers
from kvgraft.model.transformer import Transformer


def export_adapter_deepseek_v3(
    adapter_dir: str | Path, model: Transformer, out_dir: str | Path, latent_norm: str = "pad"
) -> Path:
    """Write the adapter at ``adapter_dir`` (trained on ``model``) for the stock DeepSeek-V3 export of ``model``.

    ``latent_norm``: the strategy the model's export used when it has no latent norm of its own (as
    ``export_deepseek_v3``'s argument; only the exact "pad" of ``target="transformers"`` can carry an adapter)."""

    cfg = model.config
    meta = read_meta(adapter_dir)
    if meta["base_fingerprint"] != base_fingerprint(cfg):
        raise ConfigError(f"adapter {adapter_dir} was not trained on this model")
    check_base(meta, model, adapter_dir)  # the same weights too (when the adapter records them)
    if set(cfg.attention_kinds) != {"mla"}:
        raise ConfigError("a stock DeepSeek-V3 export needs MLA on every layer")
    if latent_norm not in LATENT_NORM_STRATEGIES:
        raise ConfigError(f"latent_norm {latent_norm!r} is not one of {', '.join(LATENT_NORM_STRATEGIES)}")
    pad = not cfg.mla_latent_norm
    if pad and latent_norm != "pad":
        raise ConfigError(
            f"latent_norm {latent_norm!r}: the 'fit'/'scale' exports (the engine-safe default for a base "
            "without its own latent norm) change each layer's latent basis, which a kv_a/kv_b adapter "
            "would have to follow; export the base with target='transformers' (latent_norm 'pad', exact, "
            "transformers only) or give the base its own latent norm (mla_latent_norm, exact everywhere)"
        )
    if cfg.qkv_bias and query_bias_layers(model) and any(".self_attn.q_proj" in m for m in meta["modules"]):
        raise ConfigError(
            f"adapter {adapter_dir} adapts q_proj of a base whose queries have a bias: stock DeepSeek-V3 "
            "takes them through its low-rank q_a_proj/q_b_proj path, which a q_proj delta cannot follow; "
            "train the adapter without q_proj (e.g. --modules kv_b_proj o_proj)"
        )
    H, (dc, dr, dn, _) = cfg.num_heads, cfg.latent_dims()
    perm = interleave_perm(dr)
    q_fold = stock_rope_parameters(cfg)[1]
    # exact latent norm: rows rescaled so stock's eps acts as kvgraft's; "pad": rows kept, one zero row added
    s = 1.0 if pad else (STOCK_LATENT_NORM_EPS / cfg.rms_norm_eps) ** 0.5
    mlp = [m for m in meta["modules"] if ".mlp." in m]
    if mlp:
        raise ConfigError(
            f"adapter {adapter_dir} has MLP modules ({', '.join(mlp[:3])}{' ...' if len(mlp) > 3 else ''}): "
            "PEFT rewrites gate/up/down targets on deepseek_v3 into MoE expert parameters and would drop "
            "them silently; export an attention-only adapter (--modules attention)"
        )
    src = Path(adapter_dir)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        t64 = t.to(torch.float64)
        if ".self_attn.q_proj.lora_B." in key:
            r = t64.shape[1]
            q = t64.view(H, dn + dr, r) * q_fold
            t64 = torch.cat([q[:, :dn], q[:, dn:][:, perm]], dim=1).reshape(H * (dn + dr), r)
        elif ".self_attn.kv_a_proj.lora_B." in key:
            pad_row = [t64.new_zeros(1, t64.shape[1])] if pad else []
            t64 = torch.cat([t64[:dc] * s, *pad_row, t64[dc:][perm]])
        elif pad and ".self_attn.kv_b_proj.lora_A." in key:  # kv_b ignores the constant coordinate
            t64 = torch.cat([t64, t64.new_zeros(t64.shape[0], 1)], dim=1)
        out[key.replace(".self_attn.kv_a_proj.", ".self_attn.kv_a_proj_with_mqa.")] = t64.to(t.dtype).contiguous()
    config = json.loads((src / "adapter_config.json").read_text())
    targets = config.get("target_modules")
    if isinstance(targets, list):
        config["target_modules"] = [
            m.replace(".self_attn.kv_a_proj", ".self_attn.kv_a_proj_with_mqa") if m.endswith(".self_attn.kv_a_proj") else m
            for m in targets
        ]
    with atomic_dir(Path(out_dir), overwrite=True) as tmp:
        save_file(out, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        meta = relocate_reference(meta, src, out_dir)  # a relative base path stays right from the new place
        (tmp / META_FILE).write_text(json.dumps(dict(meta, exported_for="deepseek_v3"), indent=2) + "\n")
    return Path(out_dir)
