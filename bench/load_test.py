"""A bounded load test of `kvgraft serve` on loopback (issue 11).

The server is the real one (``kvgraft.serve.server.build_server`` run by uvicorn on 127.0.0.1, an
ephemeral port) in a child process of this script, so its RSS is its own and the clients do not compete
with it for one interpreter lock; the clients are ``--concurrency`` asyncio workers on one
``httpx.AsyncClient`` here. Each round sends the same ``--requests`` requests: mixed models (the base and
every adapter, in turn), streaming and not, ``/v1/completions`` and ``/v1/chat/completions``, prompts from
the geometry task's test split (chat: one shared system message), ``max_tokens`` drawn from
``--max-tokens LO HI``, temperature 0.8 with a per-request seed (so every round asks for the same tokens).

Reported per round: wall time, requests/s, generated tokens/s (the server's ``usage`` counts), latency
p50/p99 (request sent to last byte), time to first token for streams (request sent to the first SSE event
carrying text), errors by HTTP status (goal: none but 429); the server's RSS after start-up and after
each round (a second identical round shows whether memory grows); and the server's own /metrics at the end.

Adapters: ``--adapter NAME=PATH`` (repeatable), or, with none given, two trained here on the geometry task
(``kvgraft adapt``'s placement presets, a few steps: ``decoder-half-r16`` with frozen KV writers, and
``all-linear-r16``), in ``--work``.

    .venv/bin/python bench/load_test.py                     # trains two adapters first (a few minutes)
    .venv/bin/python bench/load_test.py --adapter dec=PATH --adapter all=PATH --json load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import socket
import sys
import time
from collections import Counter
from pathlib import Path

from kvgraft.atomic import atomic_write_json

BASE = "kvgraft-ced-8m"
SYSTEM = "You answer geometry questions with the arithmetic and the result."


# ---- the server (child process) -------------------------------------------------------------------------
def _serve(conn, base: str, adapters: dict[str, str], options: dict) -> None:
    import uvicorn

    from kvgraft.runtime.options import EngineOptions
    from kvgraft.serve.server import build_server

    try:
        engine = EngineOptions(
            max_seqs=options["max_seqs"], max_batch_tokens=options["max_batch_tokens"], prefix_cache=options["prefix_cache"]
        )
        server = build_server(base, adapters, engine_options=engine, max_queue=options["max_queue"])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        userver = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", access_log=False))
        conn.send(("port", sock.getsockname()[1], server.config.model_name))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", None))
        raise
    conn.close()
    userver.run(sockets=[sock])


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


# ---- adapters -----------------------------------------------------------------------------------------
def train_adapters(work: Path, steps: int) -> dict[str, str]:
    from kvgraft.train.adapt import AdaptConfig, adapt

    out = {}
    for name, preset, frozen in (("dec", "decoder-half-r16", True), ("all", "all-linear-r16", False)):
        cfg = AdaptConfig(
            preset=preset,
            freeze_kv_writers=frozen,
            steps=steps,
            warmup_steps=min(10, steps // 2),
            micro_batch_size=8,
            val_examples=16,
            test_examples=16,
            accuracy_examples=0,
            progress=False,
        )
        t = time.perf_counter()
        result = adapt(BASE, "geometry", work / name, cfg)
        print(
            f"trained {name} ({preset}{' + frozen KV writers' if frozen else ''}, {steps} steps) in "
            f"{time.perf_counter() - t:.0f} s: test loss {result['test_loss']:.3f}",
            flush=True,
        )
        out[name] = str(work / name / "adapter")
    return out


# ---- the requests ---------------------------------------------------------------------------------------
def make_requests(n: int, models: list[str], max_tokens: tuple[int, int], seed: int) -> list[dict]:
    from kvgraft.train.adapt import load_task_any

    _, splits = load_task_any("geometry", seed)
    prompts = [ex.prompt for ex in splits["test"]]
    out = []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        model = models[i % len(models)]
        stream = (i // len(models)) % 2 == 0
        chat = (i // (2 * len(models))) % 2 == 1
        prompt = prompts[rng.randrange(len(prompts))]
        body = {"model": model, "max_tokens": rng.randint(*max_tokens), "temperature": 0.8, "seed": i, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if chat:
            question = prompt.removeprefix("Q: ").removesuffix("\nA:")
            body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        else:
            body["prompt"] = prompt
        out.append({"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body})
    return out


async def one(client, req: dict) -> dict:
    import httpx

    body, t0 = req["body"], time.perf_counter()
    rec = {
        "kind": ("chat" if "messages" in body else "cmpl") + ("-stream" if body["stream"] else ""),
        "model": body["model"],
        "status": None,
        "ttft": None,
        "tokens": 0,
    }
    try:
        if body["stream"]:
            async with client.stream("POST", req["path"], json=body) as r:
                rec["status"] = r.status_code
                if r.status_code != 200:
                    await r.aread()
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            rec["status"] = "stream-error"
                            break
                        if event.get("usage"):
                            rec["tokens"] = event["usage"]["completion_tokens"]
                        if rec["ttft"] is None and event.get("choices"):
                            rec["ttft"] = time.perf_counter() - t0
        else:
            r = await client.post(req["path"], json=body)
            rec["status"] = r.status_code
            if r.status_code == 200:
                rec["tokens"] = r.json()["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        rec["status"] = type(exc).__name__
    rec["latency"] = time.perf_counter() - t0
    return rec


async def run_round(url: str, requests: list[dict], concurrency: int) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    todo = iter(requests)
    records: list[dict] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as client:

        async def worker():
            for req in todo:  # one shared iterator: each worker takes the next request when it is free
                records.append(await one(client, req))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return records, wall


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return float("nan")
    v = sorted(values)
    return v[max(0, math.ceil(p / 100 * len(v)) - 1)]


def summarize(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r["status"] == 200]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    by_kind = {}
    for kind in sorted({r["kind"] for r in records}):
        ks = [r for r in ok if r["kind"] == kind]
        by_kind[kind] = {"n": len(ks), "p50_s": pct([r["latency"] for r in ks], 50), "p99_s": pct([r["latency"] for r in ks], 99)}
    return {
        "requests": len(records),
        "ok": len(ok),
        "wall_s": wall,
        "requests_per_s": len(records) / wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": pct(lat, 50),
        "latency_p99_s": pct(lat, 99),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "streams": len(ttft),
        "errors": dict(Counter(str(r["status"]) for r in records if r["status"] != 200)),
        "by_kind": by_kind,
    }


def scrape(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE)
    ap.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--work", default="runs/load-test", help="where adapters are trained when none are given")
    ap.add_argument("--train-steps", type=int, default=20)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(16, 32), metavar=("LO", "HI"))
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)

    adapters = {}
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"--adapter {spec!r} must be NAME=PATH")
        adapters[name] = path
    if not adapters:
        adapters = train_adapters(Path(args.work), args.train_steps)

    options = {
        "max_seqs": args.max_seqs,
        "max_batch_tokens": args.max_batch_tokens,
        "max_queue": args.max_queue,
        "prefix_cache": not args.no_prefix_cache,
    }
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, args.base, adapters, options), daemon=True)
    proc.start()
    if not parent.poll(300):
        proc.kill()
        raise SystemExit("the server did not start within 300 s")
    kind, port, model_name = parent.recv()
    if kind == "error":
        proc.join(10)
        raise SystemExit(f"the server failed to start: {port}")
    url = f"http://127.0.0.1:{port}"
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "base": args.base,
        "adapters": adapters,
        "options": options,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": list(args.max_tokens),
        "cpus": os.cpu_count(),
        "rounds": [],
    }
    try:
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not proc.is_alive():
                raise SystemExit("the server did not answer /health")
            time.sleep(0.1)
        models = [model_name, *adapters]
        requests = make_requests(args.requests, models, tuple(args.max_tokens), args.seed)
        rss0, _ = rss_mib(proc.pid)
        result["rss_start_mib"] = rss0
        print(f"server pid {proc.pid} on {url}: models {models}; RSS after start-up {rss0:.1f} MiB", flush=True)
        for i in range(args.rounds):
            records, wall = asyncio.run(run_round(url, requests, args.concurrency))
            s = summarize(records, wall)
            s["rss_mib"], s["hwm_mib"] = rss_mib(proc.pid)
            result["rounds"].append(s)
            print(
                f"round {i + 1}: {s['requests']} requests in {wall:.1f} s ({s['requests_per_s']:.2f} req/s, "
                f"{s['tokens_per_s']:.1f} tok/s), latency p50 {s['latency_p50_s']:.3f} s p99 "
                f"{s['latency_p99_s']:.3f} s, TTFT p50 {s['ttft_p50_s']:.3f} s p99 {s['ttft_p99_s']:.3f} s, "
                f"errors {s['errors'] or 'none'}, server RSS {s['rss_mib']:.1f} MiB (peak {s['hwm_mib']:.1f})",
                flush=True,
            )
        m = scrape(url)
        result["metrics"] = {k: v for k, v in m.items() if k.startswith("kvgraft_")}
    finally:
        proc.terminate()
        proc.join(30)
        if proc.is_alive():
            proc.kill()

    print(
        "\n| round | requests | wall s | req/s | gen tok/s | latency p50 s | latency p99 s | TTFT p50 s | "
        "TTFT p99 s | errors | server RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| start | | | | | | | | | | {result['rss_start_mib']:.1f} |")
    for i, s in enumerate(result["rounds"], 1):
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "none"
        print(
            f"| {i} | {s['requests']} | {s['wall_s']:.1f} | {s['requests_per_s']:.2f} | {s['tokens_per_s']:.1f} | "
            f"{s['latency_p50_s']:.3f} | {s['latency_p99_s']:.3f} | {s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} | "
            f"{errors} | {s['rss_mib']:.1f} |"
        )
    print(
        "\nlatency by kind (last round): "
        + "; ".join(
            f"{k} n={v['n']} p50 {v['p50_s']:.3f} s p99 {v['p99_s']:.3f} s" for k, v in result["rounds"][-1]["by_kind"].items()
        )
    )
    keys = (
        "kvgraft_requests_total",
        "kvgraft_prefix_cache",
        "kvgraft_decoder_replays_total",
        "kvgraft_cache_bytes",
        "kvgraft_preemptions_total",
        "kvgraft_engine_errors_total",
    )
    print("server /metrics at the end: " + ", ".join(f"{k} {v:g}" for k, v in result["metrics"].items() if k.startswith(keys)))
    if args.json:
        atomic_write_json(Path(args.json), result, indent=2)
    bad = {k: v for s in result["rounds"] for k, v in s["errors"].items() if k != "429"}
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
