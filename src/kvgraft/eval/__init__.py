"""Evaluation: perplexity, KV-cache bytes per token (formula vs allocation), decode speed, reports.

Typical use::

    from kvgraft.eval import evaluate, format_report, compare_table
    a = evaluate("models/kvgraft-llama-8m", json_out="runs/eval/base.json")
    print(format_report(a))
    b = evaluate("runs/converted", json_out="runs/eval/converted.json")
    print(compare_table([a, b]))
"""

from kvgraft.eval.memory import KVMemory, kv_memory
from kvgraft.eval.perplexity import PerplexityResult, perplexity, text_to_tokens
from kvgraft.eval.report import EvalOptions, compare_table, config_summary, evaluate, format_ppl, format_report
from kvgraft.eval.speed import SpeedPoint, decode_speed

__all__ = [
    "EvalOptions",
    "KVMemory",
    "PerplexityResult",
    "SpeedPoint",
    "compare_table",
    "config_summary",
    "decode_speed",
    "evaluate",
    "format_ppl",
    "format_report",
    "kv_memory",
    "perplexity",
    "text_to_tokens",
]
