"""Which adapter modules matter: gradient energy per module group and the zeroing ablation.

For a trained adapter and a task, per module group c (``q_proj``, ``kv_b_proj``, ``compressor.kv_a_proj``,
``mlp.down_proj``, ... pooled over layers):

- ``n_c / n``: its share of the adapter's parameters;
- ``G_c / G``: its share of the squared-gradient energy, summed over ``steps`` training micro-batches at
  the adapter's current weights;
- ``rho_c = (G_c / G) / (n_c / n)``: the mean squared gradient per parameter relative to the adapter's.
  With a module kappa times as sensitive, its best step is 1/kappa of the average while Adam's step stays
  near the LR, so a shared LR is about sqrt(rho_c) too large for it: the suggested multiplier is
  ``1 / sqrt(rho_c)`` (the argument of Mind Lab's article on LoRA placement; ``kvgraft adapt --lr-mult GLOB=FACTOR`` applies it);
- the zeroing ablation: validation loss with the group's adapter zeroed (others kept), and with all
  zeroed (= the base model).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from kvgraft.adapters.fingerprint import resolve_base
from kvgraft.adapters.lora import load_adapter, read_meta
from kvgraft.adapters.optim import module_name
from kvgraft.errors import ConfigError
from kvgraft.hf import load_pretrained, load_tokenizer_dir
from kvgraft.reference import resolve_model
from kvgraft.train.adapt import encode_split, load_task_any, task_seq_len
from kvgraft.train.loop import batch_indices, collate, evaluate, lm_loss


def module_group(name: str) -> str:
    """``layers.4.self_attn.compressor.kv_a_proj`` -> ``compressor.kv_a_proj``; ``layers.2.mlp.down_proj`` ->
    ``mlp.down_proj``."""
    parts = name.split(".")
    rest = parts[2:]
    if rest and rest[0] == "self_attn":
        rest = rest[1:]
    return ".".join(rest)


def probe(
    adapter_dir: str | Path,
    task: str | Path,
    base: str | Path | None = None,
    steps: int = 8,
    micro_batch_size: int = 16,
    val_examples: int = 224,
) -> dict[str, Any]:
    """Gradient energy and zeroing ablation per module group (see the module docstring)."""

    if steps < 1 or micro_batch_size < 1 or val_examples < 1:
        raise ConfigError(
            f"steps ({steps}), micro_batch_size ({micro_batch_size}) and val_examples ({val_examples}) must be >= 1"
        )
    meta = read_meta(adapter_dir)
    path = resolve_model(base) if base is not None else resolve_base(adapter_dir, meta)
    task_name, splits = load_task_any(task)
    model = load_pretrained(path).float()
    tokenizer = load_tokenizer_dir(path)
    seq_len = task_seq_len(tokenizer, splits, model.config.max_position_embeddings - 1)
    pad = model.config.eos_token_id or 0
    train = encode_split(tokenizer, splits["train"], seq_len, pad)
    val = encode_split(tokenizer, splits["validation"][:val_examples], seq_len, pad)
    pm = load_adapter(model, adapter_dir, trainable=True)
    params = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    groups: dict[str, list[str]] = defaultdict(list)
    for n in params:
        groups[module_group(module_name(n))].append(n)
    energy = {g: 0.0 for g in groups}
    pm.train()
    for i in range(steps):
        batch = collate(train, batch_indices(len(train), 0, i, micro_batch_size))
        pm.zero_grad(set_to_none=True)
        loss, _ = lm_loss(pm, batch)
        loss.backward()
        for g, names in groups.items():
            energy[g] += sum(float(params[n].grad.pow(2).sum()) for n in names if params[n].grad is not None)
    pm.zero_grad(set_to_none=True)
    pm.eval()
    total_n = sum(p.numel() for p in params.values())
    total_g = sum(energy.values()) or 1.0
    nb = math.ceil(len(val) / micro_batch_size)
    full = evaluate(pm, val, lm_loss, micro_batch_size, nb)
    rows = []
    with torch.no_grad():
        for g, names in sorted(groups.items()):
            n_c = sum(params[n].numel() for n in names)
            share_n, share_g = n_c / total_n, energy[g] / total_g
            rho = share_g / share_n
            saved = {n: params[n].detach().clone() for n in names if ".lora_B." in n}
            for n in saved:
                params[n].zero_()
            zeroed = evaluate(pm, val, lm_loss, micro_batch_size, nb)
            for n, t in saved.items():
                params[n].copy_(t)
            rows.append(
                {
                    "group": g,
                    "parameters": n_c,
                    "param_share": share_n,
                    "grad_energy_share": share_g,
                    "rho": rho,
                    "suggested_lr_multiplier": (1 / math.sqrt(rho)) if rho > 0 else None,
                    "val_loss_zeroed": zeroed,
                    "delta": zeroed - full,
                }
            )
        with pm.disable_adapter():
            base_loss = evaluate(pm, val, lm_loss, micro_batch_size, nb)
    return {
        "adapter": str(adapter_dir),
        "task": task_name,
        "steps": steps,
        "val_loss": full,
        "val_loss_all_zeroed": base_loss,
        "rows": rows,
    }


def probe_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Adapter {result['adapter']} on {result['task']}: validation loss {result['val_loss']:.4f}, all zeroed "
        f"(the base) {result['val_loss_all_zeroed']:.4f}; gradient energy over {result['steps']} micro-batches.",
        "",
        "| module group | params | n_c/n | G_c/G | rho_c | LR x 1/sqrt(rho) | val loss zeroed | delta |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        mult = "-" if r["suggested_lr_multiplier"] is None else f"{r['suggested_lr_multiplier']:.2f}"
        lines.append(
            f"| {r['group']} | {r['parameters']:,} | {r['param_share']:.3f} | {r['grad_energy_share']:.3f} | "
            f"{r['rho']:.2f} | {mult} | {r['val_loss_zeroed']:.4f} | {r['delta']:+.4f} |"
        )
    return "\n".join(lines) + "\n"
