"""Parity helpers: the same token prompts through vLLM and transformers, greedy, with top-k logprobs.

Used by the tests in this folder (``make test-vllm``, docs/vllm.md). vllm is imported only when an engine
is started and kvgraft only by the kvgraft helpers (``kvgraft_engine_greedy``, ``load_kvgraft``), so this
module imports in any environment.

    from engines import VllmRunner, load_hf, parity

    with VllmRunner("models/kvgraft-llama-8m", max_model_len=256) as runner:   # engine starts here
        report = parity(runner, load_hf("models/kvgraft-llama-8m"), prompts, n_new=32)
    assert report.same_tokens, report
    assert report.max_abs_diff < 1e-3, report

``prompts`` are lists of token ids. vLLM runs fp32, greedy, ``enforce_eager=True``, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``attention_backend="CPU_MLA"`` for DeepSeek-V2/V3 (MLA) checkpoints.
For MLA checkpoints the runner also switches vLLM's CPU ``rotary_embedding`` custom op off (``native_rope``)
by default: that op rotates the wrong elements for the strided 3-D q_pe/k_pe views vLLM's MLA layer passes
it (docs/vllm.md). Pass ``native_rope=False`` to see the defect.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

# vLLM reads these at import time; set before the first `import vllm` (setdefault: the caller may override).
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for these tiny models
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: no spawn, hooks can see the model
}

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

# compilation_config that makes vLLM use RotaryEmbedding.forward_native instead of the CPU custom op
NATIVE_ROPE = {"custom_ops": ["-rotary_embedding"]}


def vllm_available() -> tuple[bool, str]:
    """(True, version) when vllm imports here, else (False, why)."""
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    try:
        import vllm

        if getattr(vllm, "__file__", None) is None:  # a namespace package (e.g. this very folder), not vLLM
            return False, "no vllm package installed"
        from vllm import LLM  # noqa: F401
    except Exception as e:  # ImportError, or a broken wheel (CUDA-only torchvision, ...)
        return False, f"{type(e).__name__}: {e}"
    return True, vllm.__version__


def model_type(model_dir: str | os.PathLike) -> str:
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"]


@dataclass
class Greedy:
    """One prompt's greedy continuation: ``tokens[i]`` is step i's token, ``top[i]`` maps the step's top-k
    token ids to their logprobs (fp32 log-softmax of the raw logits)."""

    prompt: list[int]
    tokens: list[int]
    top: list[dict[int, float]]


class VllmRunner:
    """One vLLM engine (``vllm.LLM``) over a local HF model directory; start once, query many times.

    ``native_rope``: None = on for MLA model types (deepseek_v2/v3), off otherwise; True/False forces it.
    ``attention_backend``: None = "CPU_MLA" for MLA model types, vLLM's default otherwise.
    Other keyword arguments go to ``vllm.LLM`` and override the defaults here (e.g. ``enforce_eager=False``).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        max_model_len: int = 256,
        dtype: str = "float32",
        native_rope: bool | None = None,
        attention_backend: str | None = None,
        **llm_kwargs,
    ):
        ok, why = vllm_available()
        if not ok:
            raise RuntimeError(f"vllm is not importable: {why}")
        from vllm import LLM
        from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

        # get_rope() caches RoPE modules process-wide, and a module's forward (custom op or native) is fixed when
        # it is built: drop modules built under an earlier engine's (or no engine's) compilation config.
        _ROPE_DICT.clear()
        self.model_dir = str(model_dir)
        self.model_type = model_type(model_dir)
        mla = self.model_type in MLA_MODEL_TYPES
        if attention_backend is None and mla:
            attention_backend = "CPU_MLA"
        self.native_rope = mla if native_rope is None else native_rope
        kwargs = dict(
            model=self.model_dir,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            max_num_seqs=16,
            seed=0,
        )
        if attention_backend is not None:
            kwargs["attention_backend"] = attention_backend
        if self.native_rope:
            kwargs["compilation_config"] = dict(NATIVE_ROPE)
        kwargs.update(llm_kwargs)
        self.kwargs = kwargs
        self.llm = LLM(**kwargs)

    def greedy(self, prompts: Sequence[Sequence[int]], n_new: int = 32, top_k: int = 5) -> list[Greedy]:
        """All prompts in one ``generate`` call (vLLM batches them): n_new greedy tokens each (EOS ignored)
        and the top_k logprobs at every step."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=n_new, logprobs=top_k, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], sp, use_tqdm=False)
        runs = []
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            top = [
                {int(t): float(lp.logprob) for t, lp in step.items() if lp.rank is None or lp.rank <= top_k}
                for step in c.logprobs
            ]
            runs.append(Greedy([int(t) for t in p], [int(t) for t in c.token_ids], top))
        return runs

    def apply_model(self, fn):
        """fn(model) on the (in-process) worker's torch model; returns fn's result."""
        return self.llm.apply_model(fn)[0]

    def close(self) -> None:
        """Shut the engine down so the next runner in this process starts clean."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:
            pass

    def __enter__(self) -> VllmRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_hf(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """transformers' AutoModelForCausalLM on the directory, eval mode; fails on any missing, unexpected or
    mismatched key (``output_loading_info``), so a silently half-loaded checkpoint cannot pass parity."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    if bad:
        raise AssertionError(f"transformers loaded {model_dir} with problems: {bad}")
    return model.eval()


@torch.no_grad()
def hf_logprobs(model, sequence: Sequence[int]) -> torch.Tensor:
    """[len(sequence), vocab] fp32 log-softmax of transformers' logits over the whole sequence (one forward,
    no cache): row i is the distribution of token i + 1 given tokens 0..i."""
    logits = model(input_ids=torch.tensor([list(sequence)], dtype=torch.long)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def hf_greedy(model, prompts: Sequence[Sequence[int]], n_new: int = 32, top_k: int = 5) -> list[Greedy]:
    """transformers' own greedy continuation, one prompt at a time, recomputing the whole sequence every step
    (no cache, no batching, no padding: the plainest reference)."""
    runs = []
    for p in prompts:
        seq = [int(t) for t in p]
        tokens, top = [], []
        for _ in range(n_new):
            lp = hf_logprobs(model, seq)[-1]
            vals, ids = lp.topk(top_k)
            top.append({int(i): float(v) for i, v in zip(ids, vals)})
            tokens.append(int(ids[0]))
            seq.append(int(ids[0]))
        runs.append(Greedy([int(t) for t in p], tokens, top))
    return runs


@dataclass
class Parity:
    """vLLM vs transformers on the same prompts.

    ``diffs[i][s]``: max over vLLM's top-k tokens at step s of |vLLM logprob - transformers logprob|, with
    transformers run on vLLM's own sequence (teacher-forced), so every step compares the same prefix even
    after the greedy tokens diverge. ``first_divergence[i]``: first step where the greedy tokens differ
    (None: all equal)."""

    vllm: list[Greedy]
    hf: list[Greedy]
    diffs: list[list[float]] = field(default_factory=list)

    @property
    def first_divergence(self) -> list[int | None]:
        out = []
        for a, b in zip(self.vllm, self.hf):
            out.append(next((s for s, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None))
        return out

    @property
    def same_tokens(self) -> bool:
        return all(d is None for d in self.first_divergence) and all(
            len(a.tokens) == len(b.tokens) for a, b in zip(self.vllm, self.hf)
        )

    @property
    def max_abs_diff_per_prompt(self) -> list[float]:
        return [max(d) if d else 0.0 for d in self.diffs]

    @property
    def max_abs_diff(self) -> float:
        return max(self.max_abs_diff_per_prompt, default=0.0)

    def first_step_diff(self) -> list[float]:
        """|Δ logprob| at step 0 only (the prompt's next token: pure prefill on the vLLM side)."""
        return [d[0] if d else 0.0 for d in self.diffs]

    def __str__(self) -> str:
        rows = [f"{'prompt len':>10} {'diverges at':>11} {'max|dlogprob| step0':>20} {'all steps':>10}"]
        for run, div, d in zip(self.vllm, self.first_divergence, self.diffs):
            rows.append(f"{len(run.prompt):>10} {str(div):>11} {d[0] if d else 0:>20.3g} {max(d) if d else 0:>10.3g}")
        return "\n".join(rows)


def compare(vllm_runs: Sequence[Greedy], hf_model, hf_runs: Sequence[Greedy] | None = None) -> Parity:
    """Score vLLM's runs against transformers (teacher-forced on vLLM's sequences); ``hf_runs`` (from
    ``hf_greedy``) supplies transformers' own greedy tokens, computed here when not given."""
    if hf_runs is None:
        hf_runs = hf_greedy(
            hf_model, [r.prompt for r in vllm_runs], n_new=len(vllm_runs[0].tokens), top_k=max(len(t) for t in vllm_runs[0].top)
        )
    diffs = []
    for run in vllm_runs:
        seq = run.prompt + run.tokens
        lp = hf_logprobs(hf_model, seq[:-1])  # row len(prompt) - 1 + s: distribution of step s
        n = len(run.prompt)
        per_step = []
        for s, top in enumerate(run.top):
            row = lp[n - 1 + s]
            per_step.append(max(abs(v - float(row[t])) for t, v in top.items()))
        diffs.append(per_step)
    return Parity(list(vllm_runs), list(hf_runs), diffs)


def parity(runner: VllmRunner, hf_model, prompts: Sequence[Sequence[int]], n_new: int = 32, top_k: int = 5) -> Parity:
    """vLLM greedy (runner) and transformers greedy (hf_model) on the same prompts, compared."""
    vllm_runs = runner.greedy(prompts, n_new=n_new, top_k=top_k)
    return compare(vllm_runs, hf_model, hf_greedy(hf_model, prompts, n_new=n_new, top_k=top_k))


def write_random_deepseek_v3(out: str | os.PathLike, *, seed: int = 0, **overrides) -> Path:
    """A tiny random stock DeepSeek-V3 (transformers' own DeepseekV3Config / DeepseekV3ForCausalLM, no kvgraft
    code), fp32, saved with save_pretrained: 2 layers, hidden 256, 4 heads, no MoE (first_k_dense_replace =
    num_hidden_layers), q_lora_rank None, kv_lora_rank 512 + qk_rope_head_dim 64 (the only MLA shape vLLM's CPU
    backends take). Weights are redrawn so attention is not near-uniform: embeddings N(0, 1), projections
    N(0, 0.06), lm_head N(0, 0.2), norm weights U(0.5, 1.5)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(
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
    )
    cfg.update(overrides)
    cfg.setdefault("first_k_dense_replace", cfg["num_hidden_layers"])
    gen = torch.Generator().manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif p.dim() == 2:
                std = 1.0 if "embed_tokens" in name else 0.2 if "lm_head" in name else 0.06
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    out = Path(out)
    model.save_pretrained(out)
    return out


def random_prompts(lengths: Sequence[int], vocab: int, seed: int = 0, low: int = 2) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=gen).tolist() for n in lengths]


def load_kvgraft(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """kvgraft's own Transformer of a checkpoint directory (``kvgraft.hf.load_pretrained``), eval mode."""
    from kvgraft.hf import load_pretrained

    return load_pretrained(model_dir, dtype=dtype)


@torch.no_grad()
def kvgraft_engine_greedy(model, prompts: Sequence[Sequence[int]], n_new: int = 32, adapters=None, **engine_kwargs):
    """Greedy tokens of kvgraft's serving engine (``kvgraft.runtime.engine.Engine``, continuous batching over
    its paged cache, all prompts in one run), ``n_new`` per prompt (no stop tokens). ``adapters``: a dict of
    name -> adapter directory to load (``Engine.load_adapter``) and then one name (or None) per prompt in
    ``engine_kwargs["use"]``."""
    from kvgraft.runtime.engine import Engine
    from kvgraft.runtime.options import EngineOptions
    from kvgraft.runtime.sampling import SamplingParams as KvgraftSampling

    use = engine_kwargs.pop("use", None)
    engine = Engine(model, EngineOptions(**engine_kwargs))
    for name, path in (adapters or {}).items():
        engine.load_adapter(name, path)
    return engine.generate([list(map(int, p)) for p in prompts], KvgraftSampling(max_new_tokens=n_new), use)


@torch.no_grad()
def kvgraft_logprobs(model, sequence: Sequence[int]) -> torch.Tensor:
    """[len(sequence), vocab] fp32 log-softmax of kvgraft's cache-free forward over the whole sequence."""
    logits = model(torch.tensor([list(sequence)], dtype=torch.long))[0]
    return torch.log_softmax(logits.float(), dim=-1)


def kvgraft_parity(
    runner: VllmRunner, model, prompts: Sequence[Sequence[int]], n_new: int = 32, top_k: int = 5, **engine_kwargs
) -> Parity:
    """vLLM greedy (runner) against kvgraft's engine greedy tokens on the same prompts; ``diffs`` compare
    vLLM's top-k logprobs with kvgraft's cache-free forward teacher-forced on vLLM's own sequence."""
    vllm_runs = runner.greedy(prompts, n_new=n_new, top_k=top_k)
    ours = kvgraft_engine_greedy(model, prompts, n_new, **engine_kwargs)
    diffs = []
    for run in vllm_runs:
        lp = kvgraft_logprobs(model, (run.prompt + run.tokens)[:-1])
        n = len(run.prompt)
        diffs.append([max(abs(v - float(lp[n - 1 + s][t])) for t, v in top.items()) for s, top in enumerate(run.top)])
    return Parity(list(vllm_runs), [Greedy(list(p), list(t), []) for p, t in zip(prompts, ours)], diffs)
