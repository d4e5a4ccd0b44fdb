"""One evaluation report per model (perplexity, KV bytes/token, decode speed), as a dict, JSON and text.

The dict returned by :func:`evaluate` is JSON-ready (``json.loads(json.dumps(d)) == d``); the text
views are :func:`format_report` (one model) and :func:`compare_table` (models side by side, e.g. an
original and its converted version).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvgraft.atomic import atomic_write_text
from kvgraft.checks import check_int, check_writable
from kvgraft.errors import ConfigError
from kvgraft.eval.memory import dtype_name, kv_memory
from kvgraft.eval.perplexity import perplexity, text_to_tokens
from kvgraft.eval.speed import decode_speed
from kvgraft.hf import load_pretrained, load_tokenizer_dir
from kvgraft.model.transformer import Transformer

HELDOUT = Path("eval") / "heldout.npy"
CALIBRATION = Path("eval") / "calibration.npy"


# ------------------------------------------------------------------------------------ evaluate


def _resolve_tokens(
    model_path: Path | None, tokens: np.ndarray | str | Path | None, text_file: str | Path | None
) -> tuple[str, Any]:
    """(source kind, payload) for the evaluation tokens; raises before any model is loaded."""
    if tokens is not None:
        return "tokens", tokens
    if text_file is not None:
        if model_path is None:
            raise ConfigError(
                f"text_file={str(text_file)!r} needs a tokenizer: pass model_path (a model directory "
                "holding a tokenizer) or tokenize it yourself and pass tokens="
            )
        return "text_file", Path(text_file)
    if model_path is not None and (model_path / HELDOUT).is_file():
        return "heldout", model_path / HELDOUT
    where = f"{model_path} has no {HELDOUT}" if model_path is not None else "no model_path was given"
    raise ConfigError(
        f"no evaluation tokens ({where}): pass tokens= (a 1-D token array or .npy path), "
        f"text_file= (tokenized with the model directory's tokenizer) or a model directory shipping {HELDOUT}"
    )


def check_eval_args(
    seq_len: int | None = None,
    max_tokens: int | None = None,
    contexts: Sequence[int] = (128,),
    batch_sizes: Sequence[int] = (1,),
    new_tokens: int = 32,
    batch_size: int = 8,
) -> None:
    """Raise ValueError naming the first bad value; runs before any model or token file is touched."""

    for name, value in (("seq_len", seq_len), ("max_tokens", max_tokens)):
        check_int(name, value, low=1, optional=True, accepted="a positive integer")
    if seq_len is not None and max_tokens is not None and max_tokens < seq_len:
        raise ConfigError(f"max_tokens ({max_tokens}) must be >= seq_len ({seq_len}) to score one window")
    for name, values in (("contexts", contexts), ("batch_sizes", batch_sizes)):
        if not len(values):
            raise ConfigError(f"{name} must list at least one value")
        for v in values:
            check_int(f"{name} entry", v, low=1)
    check_int("new_tokens", new_tokens, low=1)
    check_int("batch_size", batch_size, low=1)


def config_summary(config: Any) -> dict[str, Any]:
    """The shape facts a report shows: layers, heads, kv heads, head_dim, attention kinds, KV slots."""
    return {
        "layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_kinds": dict(Counter(config.attention_kinds)),
        "layer_types": dict(Counter(config.layer_types)),
        "kv_slots": config.num_slots,
    }


@dataclass(frozen=True)
class EvalOptions:
    """How :func:`evaluate` measures: ``seq_len`` (perplexity window; None: the model's context),
    ``batch_size``/``max_tokens`` for :func:`perplexity`; decode speed at every ``contexts`` x
    ``batch_sizes`` point over ``new_tokens`` steps, ``warmup`` (capped at ``new_tokens - 1``) and ``repeats``
    for :func:`decode_speed`; KV memory at ``kv_dtype`` (bf16 by default, the deployment dtype)."""

    seq_len: int | None = None
    contexts: Sequence[int] = (128, 512, 2048)
    batch_sizes: Sequence[int] = (1, 8)
    new_tokens: int = 32
    batch_size: int = 8
    max_tokens: int | None = None
    kv_dtype: torch.dtype = torch.bfloat16
    warmup: int = 4
    repeats: int = 3
    progress: bool = True


def evaluate(
    model_path: str | Path | None = None,
    model: Transformer | None = None,
    tokens: np.ndarray | str | Path | None = None,
    text_file: str | Path | None = None,
    options: EvalOptions | None = None,
    *,
    name: str | None = None,
    json_out: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Evaluate one model: perplexity, KV-cache memory and decode speed, as a JSON-ready dict.

    The model is ``model`` or, when only ``model_path`` is given, ``kvgraft.hf.load_pretrained(model_path,
    dtype)``. Evaluation tokens, first match wins: ``tokens`` (array or ``.npy`` path); ``text_file``
    tokenized with the tokenizer in ``model_path``; ``model_path/eval/heldout.npy``. Without any of
    them a ``ValueError`` says what to pass (raised before loading the model). ``name`` labels the
    model in tables (default: the path, else the class name). ``options``: how it is measured
    (:class:`EvalOptions`; None: its defaults). With ``json_out`` the dict is also written there atomically
    as JSON.
    """
    o = options or EvalOptions()
    seq_len, max_tokens, new_tokens = o.seq_len, o.max_tokens, o.new_tokens
    if model is None and model_path is None:
        raise ConfigError("evaluate needs model_path (a model directory) or model (a loaded model)")
    check_eval_args(seq_len, max_tokens, tuple(o.contexts), tuple(o.batch_sizes), new_tokens, o.batch_size)
    if json_out is not None:
        check_writable(json_out, what="JSON report")
    path = Path(model_path) if model_path is not None else None
    source, payload = _resolve_tokens(path, tokens, text_file)
    if source == "text_file":
        assert path is not None  # _resolve_tokens chose the text file only with a model directory
        tokenizer = load_tokenizer_dir(path)
        if tokenizer is None:
            raise ConfigError(f"text_file given but {path} holds no tokenizer; pass tokens= instead")
        payload = text_to_tokens(payload, tokenizer)
        token_source = f"text_file:{text_file}"
    elif source == "heldout":
        token_source = str(payload)
    else:
        token_source = str(payload) if isinstance(payload, (str, Path)) else "array"
    if model is None:  # once the tokens are known to be readable
        assert path is not None  # checked at the top: one of model and model_path is given
        model = load_pretrained(path, dtype=dtype)

    config = model.config
    param_dtype = next(model.parameters()).dtype
    ppl = perplexity(model, payload, seq_len=seq_len, batch_size=o.batch_size, max_tokens=max_tokens, progress=o.progress)
    memory = kv_memory(model, dtype=o.kv_dtype)
    speed = decode_speed(
        model,
        contexts=tuple(o.contexts),
        batch_sizes=tuple(o.batch_sizes),
        new_tokens=new_tokens,
        warmup=min(o.warmup, new_tokens - 1),
        repeats=o.repeats,
    )
    result: dict[str, Any] = {
        "model": name or (str(model_path) if model_path is not None else type(model).__name__),
        "params": int(sum(p.numel() for p in model.parameters())),
        "dtype": dtype_name(param_dtype),
        "config": config_summary(config),
        "eval_tokens": token_source,
        "perplexity": ppl.to_dict(),
        "kv_memory": memory.to_dict(),
        "speed": {"new_tokens": new_tokens, "points": [p.to_dict() for p in speed]},
    }
    if json_out is not None:
        atomic_write_text(json_out, json.dumps(result, indent=2) + "\n")
    return result


# ------------------------------------------------------------------------------------ text views


def format_ppl(value: float) -> str:
    """How reports print a perplexity (3 decimals)."""
    return f"{value:.3f}"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _human_count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def _context_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Aligned columns: the first ``left`` columns left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_report(result: dict[str, Any]) -> str:
    """A plain-text terminal report of one :func:`evaluate` result."""
    cfg, ppl, mem = result["config"], result["perplexity"], result["kv_memory"]
    kinds = ", ".join(f"{k} x{n}" for k, n in cfg["attention_kinds"].items())
    lines = [
        f"model       {result['model']}",
        f"params      {_human_count(result['params'])} ({result['params']:,}), {result.get('dtype', '?')}",
        f"config      {cfg['layers']} layers, {cfg['heads']} heads, {cfg['kv_heads']} kv heads, "
        f"head_dim {cfg['head_dim']}, {cfg['kv_slots']} kv slots; attention {kinds}",
        f"perplexity  {format_ppl(ppl['ppl'])}  (loss {ppl['loss']:.4f} nats/token over "
        f"{ppl['tokens_scored']:,} tokens, seq_len {ppl['seq_len']})",
        f"KV cache    {mem['dtype']}: formula {mem['bytes_per_token_formula']:,.0f} B/token, measured "
        f"{mem['bytes_per_token_measured']:,.1f} B/token ({'agree' if mem['agree'] else 'DISAGREE'})",
    ]
    if mem["per_context"]:
        per = ", ".join(f"{_context_label(int(c))}: {_human_bytes(b)}" for c, b in mem["per_context"].items())
        lines.append(f"            per sequence at context {per}")
    points = result["speed"]["points"]
    if points:
        lines.append("")
        lines.append(f"decode speed ({result['speed']['new_tokens']} new tokens per run; * = past max positions)")
        rows = [
            [
                f"{p['context']}{'*' if p.get('beyond_max_positions') else ''}",
                str(p["batch_size"]),
                f"{p['tokens_per_s']:,.1f}",
                f"{p['ms_per_token_median']:.3f}",
                f"{p['prefill_s']:.4f}",
            ]
            for p in points
        ]
        lines += _table(["context", "batch", "tokens/s", "ms/token", "prefill s"], rows, left=0)
    return "\n".join(lines)


def _metrics(result: dict[str, Any]) -> dict[str, tuple[float | None, str]]:
    """Metric name -> (value, formatted) for :func:`compare_table`, in display order."""
    ppl, mem = result["perplexity"], result["kv_memory"]
    rows: dict[str, tuple[float | None, str]] = {
        "params": (result["params"], _human_count(result["params"])),
        "perplexity": (ppl["ppl"], format_ppl(ppl["ppl"])),
        "loss (nats/token)": (ppl["loss"], f"{ppl['loss']:.4f}"),
        f"KV B/token formula ({mem['dtype']})": (mem["bytes_per_token_formula"], f"{mem['bytes_per_token_formula']:,.0f}"),
        f"KV B/token measured ({mem['dtype']})": (mem["bytes_per_token_measured"], f"{mem['bytes_per_token_measured']:,.1f}"),
    }
    for c, b in mem["per_context"].items():
        rows[f"KV per seq @ {_context_label(int(c))}"] = (b, _human_bytes(b))
    for p in result["speed"]["points"]:
        key = f"ctx {p['context']} x b{p['batch_size']}"
        rows[f"{key} tokens/s"] = (p["tokens_per_s"], f"{p['tokens_per_s']:,.1f}")
        rows[f"{key} ms/token"] = (p["ms_per_token_median"], f"{p['ms_per_token_median']:.3f}")
    return rows


def _label(result: dict[str, Any]) -> str:
    name = str(result["model"])
    return Path(name).name or name


def compare_table(results: list[dict[str, Any]]) -> str:
    """Models side by side: one row per metric, one column per model, then ``<model>/<first>`` ratios.

    Metrics missing from a model (e.g. a speed point it was not measured at) show ``-``.
    """
    if not results:
        raise ConfigError("compare_table needs at least one evaluate() result")
    labels = [_label(r) for r in results]
    if len(set(labels)) < len(labels):  # same directory name in different places: show full names
        labels = [str(r["model"]) for r in results]
    metrics = [_metrics(r) for r in results]
    names: list[str] = []
    for m in metrics:
        names += [k for k in m if k not in names]
    header = ["metric", *labels, *(f"{lab}/{labels[0]}" for lab in labels[1:])]
    rows = []
    for key in names:
        cells = [m[key][1] if key in m else "-" for m in metrics]
        base = metrics[0].get(key, (None, ""))[0]
        for m in metrics[1:]:
            value = m.get(key, (None, ""))[0]
            cells.append(f"{value / base:.3f}x" if base is not None and value is not None and base != 0 else "-")
        rows.append([key, *cells])
    return "\n".join(_table(header, rows))
