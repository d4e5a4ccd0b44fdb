"""The placement study's cache-sharing adapters served together over one cache by ``kvgraft serve`` (issue 35
part 3): chat completions against kvgraft's engine, answer for answer.

    .venv/bin/python bench/real_ced_serve.py [--study runs/real-placement] [--n 4] [--out FILE]

Every cache-sharing adapter the study trained (``decoder-half-r16+frozen-kv-writers``, each task and seed under
``--study``) is loaded by one ``kvgraft serve runs/real-ced/healed --adapter NAME=DIR ...`` started here on a free
local port. Each adapter gets ``--n`` of its own run's test problems (the task as that run generated it: the
study's sizing and the run's seed) as chat completions (the prompt as one user message, temperature 0), all sent
at once from threads so the server batches requests of different adapters together. The same prompts, through
the tokenizer's chat template, run greedily on ``kvgraft.runtime.Engine`` in this process with the same
adapters loaded. The base model answers each task's seed-0 problems too (zero-shot, beside the adapters).

Then one cache for all: a recall problem none of the above asked is sent to the base alone (its prompt is then in the server's
prefix cache), then to every adapter at once; the server's ``/metrics`` counters say how many of those requests
found the cached prefix and were served by a decoder replay (the adapters change only the decoder layers, so the
encoder's windows and the shared stream are reused, not recomputed). Their replies are compared with the engine's
too. Prints, per model, the replies equal to the engine's and the answers the task's checker accepts (served and
engine); writes ``--out`` (JSON, atomically). Exit status 1 when any reply differs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "runs" / "real-ced" / "healed"
SHARING = "decoder-half-r16+frozen-kv-writers"
MAX_NEW = {"recall": 8, "ui-reply": 320}


def study_adapters(study: Path) -> dict[str, tuple[str, int, Path, Path]]:
    """name -> (task, seed, adapter directory) of every finished cache-sharing run under ``study``: the study's
    frozen decoder halves and the placement curve's runs (layers k..29, writers frozen)."""
    found = {}
    for task_dir in sorted(p for p in study.iterdir() if (p / "study_config.json").is_file()):
        task = json.loads((task_dir / "study_config.json").read_text())["task"]
        for run in sorted([*(task_dir / "runs" / SHARING).glob("seed*"), *(task_dir / "runs").glob("from*/seed*")]):
            if (run / "result.json").is_file() and (run / "adapter").is_dir():
                seed = int(run.name.removeprefix("seed"))
                where = f"-{run.parent.name}" if run.parent.name.startswith("from") else ""
                found[f"{task}{where}-s{seed}"] = (task, seed, run / "adapter", task_dir)
    return found


def problems(task_dir: Path, task: str, seed: int, n: int, tokenizer_dir: Path):
    """The first ``n`` test problems of the run's task, as the study generated it (its recorded sizing)."""
    from kvgraft.data.tasks import generate_task, load_sizing

    cfg = json.loads((task_dir / "study_config.json").read_text())
    sizing = load_sizing(
        tokenizer_dir, window=cfg["task_window"], max_tokens=cfg["task_max_tokens"], prompt_format=cfg["prompt_format"]
    )
    return generate_task(task, seed=seed, sizing=sizing)["test"][:n], sizing.encoding


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(adapters: dict[str, tuple[str, int, Path, Path]], port: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvgraft", "serve", str(BASE), "--port", str(port), "--log-level", "warning"]
    for name, (_, _, path, _) in adapters.items():
        cmd += ["--adapter", f"{name}={path}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def wait_ready(client, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"kvgraft serve exited with status {proc.returncode} before it was ready")
        try:
            client.models.list()
            return
        except Exception:  # not listening yet
            time.sleep(1.0)
    raise SystemExit(f"kvgraft serve was not ready after {timeout:.0f} s")


def counters(port: int) -> dict[str, float]:
    """The server's prefix-cache hits and decoder replays so far (its /metrics, Prometheus text)."""
    import httpx

    names = {"hits": "kvgraft_prefix_cache_hits_total", "replays": "kvgraft_decoder_replays_total"}
    names["replayed_tokens"] = "kvgraft_decoder_replayed_tokens_total"
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}
    return {k: values[v] for k, v in names.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", type=Path, default=ROOT / "runs" / "real-placement")
    ap.add_argument("--n", type=int, default=4, help="test problems per adapter (>= 1)")
    ap.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "real_ced_serve.json")
    args = ap.parse_args()
    if args.n < 1 or args.threads < 1:
        ap.error(f"--n ({args.n}) and --threads ({args.threads}) must be >= 1")
    if not (BASE / "config.json").is_file():
        raise SystemExit(f"{BASE} is missing: `.venv/bin/python bench/real_heal.py build --student ced`")
    if not args.study.is_dir():
        raise SystemExit(f"{args.study} is not a directory: run `bench/real_placement.py run` first")
    adapters = study_adapters(args.study)
    if not adapters:
        raise SystemExit(f"no finished {SHARING} run under {args.study}")

    import openai
    import torch

    from kvgraft.atomic import atomic_write_json
    from kvgraft.data.tasks import is_correct
    from kvgraft.hf import load_pretrained, load_tokenizer_dir
    from kvgraft.runtime.engine import Engine
    from kvgraft.runtime.options import EngineOptions
    from kvgraft.runtime.sampling import SamplingParams

    tokenizer = load_tokenizer_dir(BASE)
    jobs = []  # (model name: an adapter or the base, task, example, encoding)
    fresh = {}  # per task, a problem no request of the first phase asks (its prompt is not cached yet)
    for task, task_dir in sorted({t: d for t, _, _, d in adapters.values()}.items()):
        examples, encoding = problems(task_dir, task, 0, args.n + 1, BASE)
        jobs += [(BASE.name, task, ex, encoding) for ex in examples[:-1]]
        fresh[task] = (task, examples[-1], encoding)
    for name, (task, seed, _, task_dir) in adapters.items():
        examples, encoding = problems(task_dir, task, seed, args.n, BASE)
        jobs += [(name, task, ex, encoding) for ex in examples]
    shared_task = "recall" if any(t == "recall" for t, *_ in adapters.values()) else jobs[0][1]
    shared = fresh[shared_task]  # (task, example, encoding): one prompt for all
    print(f"{len(adapters)} adapters ({', '.join(adapters)}), {len(jobs)} requests", flush=True)

    port = free_port()
    proc = start_server(adapters, port, args.threads)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=1800)
        wait_ready(client, proc)

        def ask(job):
            name, task, ex, _ = job
            r = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": ex.prompt}],
                temperature=0,
                max_tokens=MAX_NEW[task],
            )
            return r.choices[0].message.content, r.usage.prompt_tokens

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(jobs)) as pool:
            served = list(pool.map(ask, jobs))
        served_s = time.perf_counter() - t0
        # one prompt, the base first, then every adapter at once over the cached prefix
        ask((BASE.name, *shared))
        before = counters(port)
        with ThreadPoolExecutor(len(adapters)) as pool:
            shared_served = list(pool.map(ask, [(name, *shared) for name in adapters]))
        after = counters(port)
        reuse = {k: after[k] - before[k] for k in after}
    finally:
        proc.terminate()
        proc.wait(60)

    torch.set_num_threads(args.threads)
    model = load_pretrained(BASE).eval()
    prompts = [enc.prompt_ids(ex.prompt) for _, _, ex, enc in jobs]
    engine = Engine(
        model,
        EngineOptions(max_seqs=len(jobs), max_batch_tokens=2048, max_seq_len=max(map(len, prompts)) + max(MAX_NEW.values())),
    )
    for name, (_, _, path, _) in adapters.items():
        engine.load_adapter(name, path)
    jobs += [(name, *shared) for name in adapters]
    served += shared_served
    prompts = [enc.prompt_ids(ex.prompt) for _, _, ex, enc in jobs]
    params = [SamplingParams(max_new_tokens=MAX_NEW[task], stop_token_ids=enc.stop_ids) for _, task, _, enc in jobs]
    outs = engine.generate(prompts, params, [None if name == BASE.name else name for name, *_ in jobs])
    ours = [tokenizer.decode(enc.cut_at_stop(o), skip_special_tokens=True) for o, (*_, enc) in zip(outs, jobs)]

    rows, differ = [], 0
    for (name, task, ex, _), (text, n_prompt), mine, ids in zip(jobs, served, ours, prompts):
        same = text == mine
        differ += not same
        rows.append(
            {
                "adapter": name,
                "task": task,
                "prompt_tokens": {"served": n_prompt, "engine": len(ids)},
                "same": same,
                "served_correct": bool(is_correct(task, ex, text)),
                "engine_correct": bool(is_correct(task, ex, mine)),
                "served": text,
                "engine": mine,
            }
        )
        if not same:
            print(f"DIFFERS ({name}): served {text!r}\n  engine {mine!r}")
    print("| adapter | replies equal to the engine's | served correct | engine correct |")
    print("|---|---:|---:|---:|")
    for name in [BASE.name, *adapters]:
        rs = [r for r in rows if r["adapter"] == name]
        print(
            f"| {name} | {sum(r['same'] for r in rs)}/{len(rs)} | {sum(r['served_correct'] for r in rs)}/{len(rs)} | "
            f"{sum(r['engine_correct'] for r in rs)}/{len(rs)} |"
        )
    print(f"{len(jobs) - differ}/{len(jobs)} replies equal; served in {served_s:.1f} s (not a benchmark)")
    print(
        f"one {shared[0]} prompt ({len(shared[2].prompt_ids(shared[1].prompt))} tokens), the base first, then {len(adapters)} "
        f"adapters at once: prefix-cache hits {reuse['hits']}, decoder replays {reuse['replays']} "
        f"({reuse['replayed_tokens']} token positions replayed)"
    )
    atomic_write_json(
        args.out,
        {
            "adapters": {k: str(v[2].resolve().relative_to(ROOT)) for k, v in adapters.items()},
            "rows": rows,
            "shared_prompt_reuse": reuse,
        },
    )
    raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main()
