"""``kvgraft serve``: the OpenAI-compatible server, many adapters over one cache."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvgraft.errors import ConfigError, refusals_as_config_errors
from kvgraft.model.packed import packed_bytes
from kvgraft.runtime.budget import KVBudget, parse_kv_budget
from kvgraft.runtime.options import EngineOptions
from kvgraft.serve.server import KvgraftServer, build_server
from kvgraft.serve.server import serve as run_server


def serve(args: argparse.Namespace) -> int:
    adapters: dict[str, str | Path] = {}
    for spec in args.adapter or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--adapter {spec!r} must be NAME=PATH")
        if name in adapters:
            raise ConfigError(f"--adapter names {name!r} twice")
        adapters[name] = path
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port ({args.port}) must be in 1..65535")
    with refusals_as_config_errors():  # the runtime refuses bad values with a plain ValueError
        kv_budget = None if args.kv_budget is None else parse_kv_budget(args.kv_budget)
        server = _build(args, adapters, kv_budget)
    served = sorted(server.engine.adapters.adapters)
    print(server.engine.pool, flush=True)  # the budget and the concurrency it buys
    if server.engine.packed_linears:
        print(
            f"{server.engine.packed_linears} linear layers on oneDNN-packed weights "
            f"({packed_bytes(server.engine.model) / 2**20:.0f} MiB more)",
            flush=True,
        )
    print(
        f"serving {server.config.model_name} with adapters {', '.join(served) or 'none'} on http://{args.host}:{args.port}/v1",
        flush=True,
    )
    run_server(server, args.host, args.port, log_level=args.log_level)
    return 0


def _build(args: argparse.Namespace, adapters: dict[str, str | Path], kv_budget: KVBudget) -> KvgraftServer:
    return build_server(
        args.model,
        adapters,
        model_name=args.model_name,
        engine_options=EngineOptions(
            max_seqs=args.max_seqs,
            max_batch_tokens=args.max_batch_tokens,
            max_seq_len=args.max_seq_len,
            kv_budget=kv_budget,
            dtype=args.dtype,
            prefix_cache=not args.no_prefix_cache,
            prefault=args.prefault,
        ),
        max_queue=args.max_queue,
        max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes,
        adapter_dir=args.adapter_dir,
        with_shipped_adapters=not args.no_shipped_adapters,
    )
