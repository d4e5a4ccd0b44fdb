"""vLLM vs transformers on a random *stock* DeepSeek-V3, on a CUDA GPU: the GPU side of the CPU parity check in
tests/vllm/test_vllm_deepseek_v3.py (docs/vllm.md). Standalone: needs torch with CUDA, transformers and vLLM
(a CUDA build), no kvgraft.

    python bench/gpu_check_vllm_parity.py [--out DIR] [--dtypes float32 bfloat16]

On CPU, vLLM 0.32's ``rotary_embedding`` custom op rotates the wrong rows of the strided 3-D q_pe / k_pe views
that vLLM's MLA layer hands it (enforce_eager, custom ops on), so a stock DeepSeek-V3 agrees with
transformers for a 1-token prompt only. This script checks the same two things on the GPU:

1. the op: ``RotaryEmbedding.forward_cuda`` on exactly those views (q[..., nope:] of [T, H, nope + 64], and
   k_pe = kv[:, 512:].unsqueeze(1)) vs ``forward_native``, fp32 and bf16;
2. the engine: greedy tokens and top-5 logprobs of vLLM (default MLA backend for the GPU; fp32 when the
   backend takes it, else bf16) vs transformers fp32, prompts of 1, 2, 4, 20, 100 tokens x 32 new tokens,
   with ``enforce_eager=True`` (custom ops on: the CUDA rotary kernel) and ``enforce_eager=False``.

Prints a table and writes ``vllm_parity.json`` under --out. Exit status 1 if the op check fails or an engine
run disagrees by more than the tolerance (fp32: 1e-3 and the same greedy tokens; bf16 or fp16: 0.3 on the
first step's top-5 logprobs of every prompt: vLLM's compiled CPU run in bf16 stays within 0.12 of transformers
fp32 there, the CPU defect gives 0.6-2.3). vLLM 0.32's GPU MLA backends take only fp16/bf16, so the fp32 engine
runs are expected to be refused at start (reported, not a failure); the fp32 op check is the exact one.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: one model at a time

import torch  # noqa: E402

from kvgraft.atomic import atomic_write_json  # noqa: E402

LENGTHS = (1, 2, 4, 20, 100)
N_NEW = 32
TOL = {"float32": 1e-3, "bfloat16": 0.3, "float16": 0.3}


def write_random_deepseek_v3(out: Path, seed: int = 0) -> Path:
    """Same model as tests/vllm/engines.py: transformers' DeepseekV3ForCausalLM, 2 dense layers, hidden 256,
    4 heads, q_lora_rank None, kv_lora_rank 512 + qk_rope_head_dim 64, fp32."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        first_k_dense_replace=2,
    )
    gen = torch.Generator().manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif p.dim() == 2:
                std = 1.0 if "embed_tokens" in name else 0.2 if "lm_head" in name else 0.06
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out)
    return out


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in LENGTHS]


def op_check() -> dict:
    """forward_cuda on the MLA layer's views vs forward_native."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT, get_rope

    out = {}
    T, H, nope = 7, 4, 64
    for dtype in (torch.float32, torch.bfloat16):
        with set_current_vllm_config(VllmConfig()):
            rope = get_rope(
                64,
                max_position=256,
                is_neox_style=False,
                dtype=dtype,
                rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            ).cuda()
        _ROPE_DICT.clear()
        g = torch.Generator().manual_seed(0)
        pos = torch.arange(3, 3 + T).cuda()
        q = torch.randn(T, H, nope + 64, generator=g).to("cuda", dtype)
        kv = torch.randn(T, 512 + 64, generator=g).to("cuda", dtype)
        q_ref, k_ref = rope.forward_native(pos, q[..., nope:].clone(), kv[:, 512:].unsqueeze(1).clone())
        q_op, kv_op = q.clone(), kv.clone()
        rope.forward_cuda(pos, q_op[..., nope:], kv_op[:, 512:].unsqueeze(1))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        res = {
            "max_abs_q": float((q_op[..., nope:] - q_ref).abs().max()),
            "max_abs_k": float((kv_op[:, 512:] - k_ref[:, 0]).abs().max()),
            "latent_untouched": bool(torch.equal(kv_op[:, :512], kv[:, :512])),
            "q_nope_untouched": bool(torch.equal(q_op[..., :nope], q[..., :nope])),
        }
        res["ok"] = res["max_abs_q"] < tol and res["max_abs_k"] < tol and res["latent_untouched"] and res["q_nope_untouched"]
        out[str(dtype).replace("torch.", "")] = res
    return out


@torch.no_grad()
def hf_rows(model, seq: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([seq], device="cuda")).logits[0]
    return torch.log_softmax(logits.float(), -1).cpu()


def engine_check(model_dir: Path, hf, dtype: str, enforce_eager: bool) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    _ROPE_DICT.clear()
    t0 = time.time()
    try:
        llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            enforce_eager=enforce_eager,
            max_model_len=160,
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            max_num_seqs=16,
            seed=0,
            gpu_memory_utilization=0.3,
        )
    except Exception as e:  # e.g. fp32 refused by every GPU MLA backend
        return {"started": False, "error": f"{type(e).__name__}: {e}"[:400]}
    started = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, logprobs=5, ignore_eos=True, detokenize=False)
    ps = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    rows = []
    for p, o in zip(ps, outs):
        c = o.outputs[0]
        toks = list(c.token_ids)
        lp = hf_rows(hf, p + toks[:-1])
        diffs = [max(abs(v.logprob - float(lp[len(p) - 1 + s, t])) for t, v in step.items()) for s, step in enumerate(c.logprobs)]
        hf_greedy = [int(lp[len(p) - 1 + s].argmax()) for s in range(len(toks))]  # given vLLM's prefix
        div = next((s for s, (a, b) in enumerate(zip(toks, hf_greedy)) if a != b), None)
        rows.append({"prompt_len": len(p), "first_divergence": div, "step0": diffs[0], "max": max(diffs)})
    backend = None
    try:
        backend = llm.llm_engine.vllm_config.attention_config.backend
    except Exception:
        pass
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass
    tol = TOL[dtype]
    ok = all(r["step0"] < tol for r in rows) and (
        dtype != "float32" or all(r["first_divergence"] is None and r["max"] < tol for r in rows)
    )
    return {"started": True, "start_s": round(started, 1), "backend": str(backend), "rows": rows, "ok": ok, "tolerance": tol}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench"))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(TOL))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    import transformers
    import vllm

    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  transformers {transformers.__version__}  "
        f"vllm {vllm.__version__}"
    )
    report = {"device": torch.cuda.get_device_name(), "vllm": vllm.__version__, "transformers": transformers.__version__}
    report["op"] = op_check()
    for dt, r in report["op"].items():
        print(
            f"rotary op on MLA views, {dt}: max|q - native| {r['max_abs_q']:.3g}, max|k - native| "
            f"{r['max_abs_k']:.3g}, latent untouched {r['latent_untouched']} -> {'ok' if r['ok'] else 'WRONG'}"
        )
    from transformers import AutoModelForCausalLM

    report["engine"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = write_random_deepseek_v3(Path(tmp) / "random-deepseek-v3")
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
        for dtype in args.dtypes:
            for eager in (True, False):
                key = f"{dtype}, enforce_eager={eager}"
                r = engine_check(d, hf, dtype, eager)
                report["engine"][key] = r
                if not r["started"]:
                    print(f"{key}: engine did not start: {r['error']}")
                    continue
                print(
                    f"{key} (backend {r['backend']}, start {r['start_s']} s, tolerance {r['tolerance']}):"
                    f" {'ok' if r['ok'] else 'DIFFERS'}"
                )
                print(f"  {'prompt len':>10} {'diverges at':>11} {'step0 |dlogprob|':>17} {'all steps':>10}")
                for row in r["rows"]:
                    print(
                        f"  {row['prompt_len']:>10} {str(row['first_divergence']):>11} {row['step0']:>17.3g} {row['max']:>10.3g}"
                    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "vllm_parity.json", report, indent=1)
    ran = [r for r in report["engine"].values() if r["started"]]
    ok = all(r["ok"] for r in report["op"].values()) and bool(ran) and all(r["ok"] for r in ran)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
