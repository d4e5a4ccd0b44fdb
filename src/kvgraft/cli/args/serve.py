"""``kvgraft serve``: its arguments (run by :mod:`kvgraft.cli.cmd.serve`)."""

from __future__ import annotations

from kvgraft.cli.args.common import MODEL_HELP, Subparsers


def add_serve(sub: Subparsers) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server over the engine, many adapters on one base "
        "(/v1/completions, /v1/chat/completions, /v1/models, /metrics)",
    )
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument(
        "--adapter",
        action="append",
        metavar="NAME=PATH",
        help="load an adapter directory (kvgraft adapt's OUT/adapter) under NAME (repeatable)",
    )
    p.add_argument(
        "--adapter-dir",
        default=None,
        help="directory that /v1/load_lora_adapter may load from (default: loading over HTTP is off)",
    )
    p.add_argument("--model-name", default=None, help="the base's name in requests (default: its directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-seqs", type=int, default=32, help="requests running at once (default 32: a 32-client load runs without waiting)"
    )
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per engine step")
    p.add_argument(
        "--kv-budget",
        default=None,
        metavar="BYTES|FRACTION",
        help="memory for the engine's KV cache pools: bytes ('4GiB', '512MiB') or a fraction of the memory "
        "available ('0.3', '30%%'); requests are admitted and preempted by the blocks it holds "
        "(default: 4 GiB, vLLM CPU's, or half the available memory when less; never more than --max-seqs "
        "full-length sequences need)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="longest prompt + completion in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="the weights' and KV cache's dtype (default: as the checkpoint stores them)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond --max-seqs; more get 429")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="the most max_tokens a request may ask")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body")
    p.add_argument(
        "--prefault",
        action="store_true",
        help="write every page of the KV cache pools at start, as vLLM zeroes its cache: the first requests pay "
        "no page faults; the pools take their memory at once (default: as their blocks are written)",
    )
    p.add_argument(
        "--no-prefix-cache", action="store_true", help="turn the engine's prefix cache off (every prompt is prefilled in full)"
    )
    p.add_argument(
        "--no-shipped-adapters",
        action="store_true",
        help="do not load the example adapters shipped for this base (models/adapters/, e.g. "
        "kvgraft-ced-8m-geometry for kvgraft-ced-8m), only the --adapter ones",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func="serve:serve")
