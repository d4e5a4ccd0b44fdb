"""The measurements behind docs/vllm.md ("who is wrong"), as one script. Not a test (pytest does not collect
it); run it in the vLLM environment:

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python tests/vllm/investigate_mla_rope.py

A random stock DeepSeek-V3 (transformers' own classes, no kvgraft code) is written to a temporary directory
and compared three ways: transformers, vLLM CPU (CPU_MLA, fp32) and the plain-torch reference
(dsv3_reference.py). Sections:

1. reference vs transformers (rope_interleave true / false);
2. vLLM's CPU ``rotary_embedding`` op on the exact views vLLM's MLA layer hands it, vs its own forward_native;
3. vLLM engines (custom op on = the default with enforce_eager; native RoPE; torch.compile): per-layer q_pe,
   k_pe, attention and layer outputs captured with hooks vs the reference, and next-token logprobs vs
   transformers for prompts of 1, 2, 4 and 20 tokens;
4. prefill vs decode: the 2nd step of a 1-token prompt (decode) vs the 1st step of the same 2 tokens as a
   prompt (prefill).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from dsv3_reference import ReferenceDeepseekV3  # noqa: E402
from engines import VLLM_ENV, VllmRunner, hf_logprobs, load_hf, random_prompts, write_random_deepseek_v3  # noqa: E402

for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)

LENGTHS = (1, 2, 4, 20)


def next_token_diff(vllm_top: dict[int, float], hf_row: torch.Tensor) -> float:
    return max(abs(v - float(hf_row[t])) for t, v in vllm_top.items())


def section_reference(d: Path, prompts) -> None:
    print("\n## 1. reference (plain torch, adjacent pairs, latent eps 1e-6) vs transformers")
    ref = ReferenceDeepseekV3(d)
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = load_hf(d)
    cfg = AutoConfig.from_pretrained(d)
    cfg.rope_interleave = False
    hf_half = AutoModelForCausalLM.from_pretrained(d, config=cfg, dtype=torch.float32).eval()
    for p in prompts:
        r = torch.log_softmax(ref.forward(p), -1)
        a = hf_logprobs(hf, p)
        b = hf_logprobs(hf_half, p)
        print(
            f"  prompt {len(p):>3} tokens: max|Δlogprob| all positions: transformers (rope_interleave=true) "
            f"{(r - a).abs().max():.2e}, transformers (rope_interleave=false) {(r - b).abs().max():.2e}"
        )


def section_op() -> None:
    print(
        "\n## 2. vLLM CPU rotary_embedding op on the MLA layer's views (T=3 tokens at positions 5, 6, 7; "
        "4 heads; nope 64 + rope 64; latent 512)"
    )
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        from vllm.model_executor.layers.rotary_embedding import get_rope

        rope = get_rope(
            64,
            max_position=256,
            is_neox_style=False,
            dtype=torch.float32,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        )
    T, H, dn = 3, 4, 64
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([5, 6, 7])
    q = torch.randn(T, H, dn + 64, generator=g)  # q_proj output viewed [T, H, qk_head_dim]
    kv = torch.randn(T, 512 + 64, generator=g)  # kv_a_proj_with_mqa output
    q_native, k_native = rope.forward_native(pos, q[..., dn:].clone(), kv[:, 512:].unsqueeze(1).clone())
    q_op, kv_op = q.clone(), kv.clone()
    q_pe_view, k_pe_view = q_op[..., dn:], kv_op[:, 512:].unsqueeze(1)  # exactly what mla.py passes
    print(
        f"  views: q_pe shape {tuple(q_pe_view.shape)} strides {q_pe_view.stride()}, "
        f"k_pe shape {tuple(k_pe_view.shape)} strides {k_pe_view.stride()}"
    )
    rope.forward_cpu(pos, q_pe_view, k_pe_view)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))

    def rot(x, p):
        c, s = (p * inv).cos(), (p * inv).sin()
        o = torch.empty_like(x)
        o[0::2] = x[0::2] * c - x[1::2] * s
        o[1::2] = x[1::2] * c + x[0::2] * s
        return o

    for t in range(T):
        got = []
        for h in range(H):
            match = [pp for pp in (0, 5, 6, 7) if (rot(q[t, h, dn:], pp) - q_op[t, h, dn:]).abs().max() < 1e-5]
            got.append(match[0] if match else "?")
        print(f"  token {t} (position {int(pos[t])}): q_pe of heads 0..3 rotated by positions {got}")
    print(
        f"  max|q_pe op - native| {(q_op[..., dn:] - q_native).abs().max():.3g}; "
        f"max|k_pe op - native| {(kv_op[:, 512:] - k_native[:, 0]).abs().max():.3g}; "
        f"q_nope changed: {not torch.equal(q_op[..., :dn], q[..., :dn])}; "
        f"latent changed: {not torch.equal(kv_op[:, :512], kv[:, :512])}"
    )
    q2 = q[..., dn:].reshape(T, H * 64).clone()  # the same data, flat [T, H*64] contiguous
    k2 = kv[:, 512:].clone()
    rope.forward_cpu(pos, q2, k2)
    print(
        f"  flat contiguous [T, H*64] / [T, 64] inputs: max|q - native| "
        f"{(q2.view(T, H, 64) - q_native).abs().max():.3g}, max|k - native| {(k2 - k_native[:, 0]).abs().max():.3g}"
    )


def capture_vllm(runner: VllmRunner, prompt):
    """Per layer: q_pe, k_pe after RoPE, self_attn output, layer output, for one prefill of ``prompt``."""
    model = runner.apply_model(lambda m: m)
    layers = model.model.layers
    rec, handles = {}, []
    calls = []

    def rope_pre(mod, args):
        calls.append({"pos": args[0].clone()})

    def rope_post(mod, args, out):
        calls[-1]["q_pe"], calls[-1]["k_pe"] = out[0].clone(), out[1].clone()

    rot = layers[0].self_attn.mla_attn.rotary_emb
    handles += [rot.register_forward_pre_hook(rope_pre), rot.register_forward_hook(rope_post)]
    for i, layer in enumerate(layers):
        handles.append(
            layer.self_attn.register_forward_hook(
                lambda m, a, o, i=i: rec.setdefault(i, {}).update(attn=o.clone()) if a[0].numel() == len(prompt) else None
            )
        )
        handles.append(
            layer.register_forward_hook(
                lambda m, a, o, i=i: (
                    rec.setdefault(i, {}).update(out=(o[0] + o[1]).clone()) if a[0].numel() == len(prompt) else None
                )
            )
        )
    try:
        runner.greedy([prompt], n_new=1)
    finally:
        for h in handles:
            h.remove()
    prefill = [c for c in calls if c["pos"].numel() == len(prompt)]
    for i in range(len(layers)):
        rec[i]["q_pe"], rec[i]["k_pe"] = prefill[i]["q_pe"], prefill[i]["k_pe"][:, 0]
    return rec


def section_engines(d: Path, prompts) -> None:
    print(
        "\n## 3. vLLM CPU (CPU_MLA, fp32) vs reference (per layer, 20-token prefill) and vs transformers "
        "(next token, max|Δlogprob| over vLLM's top-5)"
    )
    hf = load_hf(d)
    ref = ReferenceDeepseekV3(d)
    long = prompts[-1]
    ref_cap = {}
    ref.forward(long, capture=ref_cap)
    modes = [
        ("enforce_eager=True (CPU rotary custom op: vLLM's default here)", dict(native_rope=False), True),
        ("enforce_eager=True, custom_ops=['-rotary_embedding']", dict(native_rope=True), True),
        ("enforce_eager=False (torch.compile; custom ops off)", dict(native_rope=False, enforce_eager=False), False),
    ]
    for name, kw, hooks in modes:
        t0 = time.time()
        with VllmRunner(d, max_model_len=128, **kw) as runner:
            started = time.time() - t0
            print(f"  ### {name} (engine start {started:.0f} s)")
            if hooks:
                cap = capture_vllm(runner, long)
                for i in sorted(cap):
                    d = {k: float((cap[i][k] - ref_cap[i][k]).abs().max()) for k in ("q_pe", "k_pe", "attn", "out")}
                    print(
                        f"    layer {i}: max|Δ| vs reference  q_pe {d['q_pe']:.2e}  k_pe {d['k_pe']:.2e}  "
                        f"attn {d['attn']:.2e}  layer out {d['out']:.2e}"
                    )
            runs = runner.greedy(prompts, n_new=2)
            diffs = [next_token_diff(r.top[0], hf_logprobs(hf, r.prompt)[-1]) for r in runs]
            print(
                "    next token after prompts of "
                + ", ".join(f"{len(r.prompt)}: {x:.2g}" for r, x in zip(runs, diffs))
                + " tokens"
            )
            if hooks:
                section_decode(runner, hf, prompts[0])


def section_decode(runner: VllmRunner, hf, one) -> None:
    """Step 2 of a 1-token prompt (a decode step) vs step 1 of the same two tokens as a prompt (a prefill)."""
    dec = runner.greedy([one], n_new=2)[0]
    two = one + dec.tokens[:1]
    pre = runner.greedy([two], n_new=1)[0]
    hf_row = hf_logprobs(hf, two)[-1]
    both = max(abs(dec.top[1][t] - pre.top[0][t]) for t in dec.top[1] if t in pre.top[0])
    print(
        f"    prefill vs decode, position 1: decode vs transformers {next_token_diff(dec.top[1], hf_row):.2g}, "
        f"prefill vs transformers {next_token_diff(pre.top[0], hf_row):.2g}, decode vs prefill {both:.2g}"
    )


def main() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        d = write_random_deepseek_v3(Path(tmp) / "dsv3")
        prompts = random_prompts(LENGTHS, 512)
        section_reference(d, prompts)
        section_op()
        section_engines(d, prompts)


if __name__ == "__main__":
    main()
