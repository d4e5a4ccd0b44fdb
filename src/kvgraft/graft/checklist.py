"""The TransMLA article's troubleshooting checklist as automatic checks on a converted (or healed) model.

``kvgraft doctor --after CONVERTED --original ORIGINAL`` runs each check and prints pass/fail with
the measured value. A check that cannot apply (e.g. healing checks on a model that was not healed)
reports ``None`` and says why.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch

from kvgraft.eval import kv_memory, perplexity
from kvgraft.eval.speed import decode_speed
from kvgraft.hf import load_pretrained
from kvgraft.model import Transformer
from kvgraft.model.fields import known
from kvgraft.model.mla import MLAttention
from kvgraft.model.transformer import Block
from kvgraft.reference import resolve_model

PPL_BAR = 1.3  # one-shot perplexity at most 1.3x the original (the TransMLA article)
LATENCY_BAR = 1.15  # decode latency at most 1.15x the original (the TransMLA article)
TOKENS_BAR = 0.03  # at least 3% of the original pretraining tokens before judging (the TransMLA article)


@dataclass
class Check:
    """One check's outcome: what it ``name``s, what was expected, whether it passed, the measured value."""

    name: str
    expectation: str
    passed: bool | None  # None: not applicable
    value: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope_not_mixed(model: Transformer) -> Check:
    """The latent of a token must not depend on its position; the RoPE key must."""
    kinds = known(model.config.attention_kinds, "attention_kinds")
    layers = [i for i, k in enumerate(kinds) if k == "mla" and model.config.is_kv_writer(i)]
    name, expect = "RoPE injection", "latent identical at shifted positions; RoPE key not"
    if not layers:
        return Check(name, expect, None, "no MLA layers")
    block = cast(Block, model.layers[layers[0]])
    attn = cast(MLAttention, block.self_attn)
    x = block.input_layernorm(model.embed_tokens(torch.arange(16)[None] % model.config.vocab_size))
    pos_a = torch.arange(16)[None]
    entries = []
    for pos in (pos_a, pos_a + 100):
        cos, sin = model.rotary(pos, x.dtype)
        cos, sin = cos[..., attn.rope_cols], sin[..., attn.rope_cols]
        entries.append(attn.latent_entry(x, cos, sin))
    dc = attn.dc
    latent_diff = (entries[0][..., :dc] - entries[1][..., :dc]).abs().max().item()
    rope_diff = (entries[0][..., dc:] - entries[1][..., dc:]).abs().max().item()
    return Check(
        name,
        expect,
        latent_diff < 1e-6 and rope_diff > 1e-6,
        f"latent max change {latent_diff:.2e}, RoPE key max change {rope_diff:.2e} (layer {layers[0]})",
    )


def checklist(after: str | Path, original: str | Path, max_tokens: int = 32768) -> list[Check]:
    """Run the checks on the converted (or healed) model ``after`` against ``original`` (directories or
    shipped names; perplexity on at most ``max_tokens`` held-out tokens)."""

    after_dir, orig_dir = resolve_model(after), resolve_model(original)
    model = load_pretrained(after_dir, dtype=torch.float32)
    base = load_pretrained(orig_dir, dtype=torch.float32)
    checks: list[Check] = []
    with torch.no_grad():
        checks.append(_rope_not_mixed(model))

    heldout = next((d / "eval" / "heldout.npy" for d in (after_dir, orig_dir) if (d / "eval" / "heldout.npy").is_file()), None)
    name = "initialisation"
    expect = f"one-shot perplexity <= {PPL_BAR}x the original"
    if heldout is None:
        checks.append(Check(name, expect, None, "no eval/heldout.npy in either model directory"))
    else:
        p_new = perplexity(model, heldout, max_tokens=max_tokens, progress=False).ppl
        p_old = perplexity(base, heldout, max_tokens=max_tokens, progress=False).ppl
        ratio = p_new / p_old
        checks.append(Check(name, expect, ratio <= PPL_BAR, f"{p_new:.3f} vs {p_old:.3f} ({ratio:.3f}x)"))

    heal_record = after_dir / "heal.json"
    record = json.loads(heal_record.read_text()) if heal_record.is_file() else None
    name, expect = "mixed precision", "latent down-projections held and updated in fp32 while healing"
    if record is None:
        checks.append(Check(name, expect, None, "not healed (no heal.json)"))
    else:
        fp32 = record.get("fp32_params") or []
        mla_layers = sum(k == "mla" for k in known(model.config.attention_kinds, "attention_kinds"))
        checks.append(
            Check(name, expect, len(fp32) >= mla_layers > 0, f"{len(fp32)} fp32 parameter tensors for {mla_layers} MLA layers")
        )
    name, expect = "healing budget", f"at least {TOKENS_BAR:.0%} of the original pretraining tokens"
    if record is None or record.get("fraction_of_pretraining") is None:
        checks.append(Check(name, expect, None, "not healed, or the original's pretraining tokens are unknown"))
    else:
        frac = record["fraction_of_pretraining"]
        checks.append(Check(name, expect, frac >= TOKENS_BAR, f"{record['tokens']:,} tokens = {frac:.2%}"))

    ctx = max(16, model.config.max_position_embeddings - 32)
    t_new = decode_speed(model, contexts=(ctx,), batch_sizes=(1,), new_tokens=24, repeats=3)[0].ms_per_token_median
    t_old = decode_speed(base, contexts=(ctx,), batch_sizes=(1,), new_tokens=24, repeats=3)[0].ms_per_token_median
    checks.append(
        Check(
            "up-projection",
            f"decode latency <= {LATENCY_BAR}x the original (absorbed, context {ctx})",
            t_new / t_old <= LATENCY_BAR,
            f"{t_new:.2f} ms vs {t_old:.2f} ms ({t_new / t_old:.2f}x)",
        )
    )
    mem = kv_memory(model, dtype=torch.bfloat16, max_len=1024)
    checks.append(
        Check(
            "KV cache allocation",
            "measured cache size equals the computed size",
            mem.agree,
            f"measured {mem.bytes_per_token_measured:,.0f} B/token, computed {mem.bytes_per_token_formula:,} B/token",
        )
    )
    return checks


def format_checklist(checks: list[Check]) -> str:
    """The checks as terminal text: one [PASS]/[FAIL]/[n/a ] line each, with the measured and expected."""
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        mark = "n/a " if c.passed is None else ("PASS" if c.passed else "FAIL")
        lines.append(f"[{mark}] {c.name:<{width}}  {c.value}\n       {'':<{width}}  expected: {c.expectation}")
    return "\n".join(lines)
