"""The server under abuse: ``kill -9`` in the middle of a stream, then a restart; adapters loaded and unloaded
over HTTP while 32 clients keep requests running.

- kill -9: a real ``kvgraft serve`` subprocess over the shipped causal encoder-decoder with the shipped
  geometry adapter (a copy, in the ``--adapter-dir`` it serves from, plus a second name hot-loaded over
  HTTP). Killed while it streams: the client's stream breaks at once (no hang, no ``[DONE]``), every file
  of the adapter directory is byte-for-byte what it was (and nothing was added), and the same command on
  the same port answers again with the same text as before the kill.
- hot load/unload: 32 client threads send 96 requests (base, the shipped adapter, a hot adapter; completions
  and chat; streaming or not) while another thread loads the hot adapter, unloads it (refused while busy,
  or draining with ``wait``) and loads it again. Every request completes with the text it gets alone, or is
  refused with a documented status (404: not loaded, 409: being unloaded, 429: queue full); no 5xx, no
  hang; the engine ends with nothing in flight and the loaded adapters as the last command left them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from factories import live_uvicorn

from kvgraft.adapters.lora import AdapterConfig, add_adapter, randomize_adapter, save_adapter
from kvgraft.adapters.placement import Placement
from kvgraft.hf import load_pretrained
from kvgraft.runtime.options import EngineOptions
from kvgraft.serve.server import build_server

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "models" / "kvgraft-ced-8m"
SHIPPED = ROOT / "models" / "adapters" / "kvgraft-ced-8m-geometry"
NAME = "kvgraft-ced-8m"
PROMPTS = ["Q: A square has side 7. Area?\nA:", "Q: A rectangle is 3 by 5. Perimeter?\nA:"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path) -> sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- kill -9 ---------------------------------------------------------------------------------------------
def _start(port: int, adapter_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "kvgraft",
        "serve",
        str(BASE),
        "--adapter",
        f"geometry={adapter_dir / 'geometry'}",
        "--adapter-dir",
        str(adapter_dir),
        "--port",
        str(port),
        "--max-seqs",
        "2",
        "--log-level",
        "warning",
        "--no-shipped-adapters",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"the server exited ({proc.returncode}): {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the server did not start: {log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def _completion(url: str, model: str) -> str:
    r = httpx.post(
        url + "/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow  # a subprocess killed and restarted (or torchrun): make test-slow, run by CI
def test_kill_9_while_streaming_then_restart(tmp_path):
    adapter_dir = tmp_path / "adapters"
    shutil.copytree(SHIPPED, adapter_dir / "geometry")
    before = _tree(adapter_dir)
    port, log = _free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = _start(port, adapter_dir, log)
    try:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "geo-hot", "lora_path": "geometry"}, timeout=60)
        assert r.status_code == 200, r.text
        want = {m: _completion(url, m) for m in (NAME, "geometry", "geo-hot")}
        assert want["geometry"] == want["geo-hot"] != want[NAME]
        body = {"model": "geometry", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True, "stop": None}
        events, broke = [], None
        start = time.monotonic()
        with httpx.Client(timeout=httpx.Timeout(30)) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                try:
                    for line in stream.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 2:  # mid-stream: the engine is generating
                                os.kill(proc.pid, signal.SIGKILL)
                except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    broke = exc
        took = time.monotonic() - start
        assert proc.wait(10) == -signal.SIGKILL
        assert broke is not None, f"the stream ended cleanly after the kill ({len(events)} events)"
        assert "[DONE]" not in events and took < 25  # it broke at once; nothing hung
        assert json.loads(events[0])["choices"][0]["finish_reason"] is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert _tree(adapter_dir) == before  # every file as it was, none added (no temporary files left)

    proc = _start(port, adapter_dir, log)  # the same command, the same port
    try:
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]] == [NAME, "geometry"]
        assert {m: _completion(url, m) for m in (NAME, "geometry")} == {m: want[m] for m in (NAME, "geometry")}
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "geo-hot", "lora_path": "geometry"}, timeout=60)
        assert r.status_code == 200 and _completion(url, "geo-hot") == want["geo-hot"]
        with httpx.Client(timeout=60) as http:
            lines = [
                ln
                for ln in http.post(url + "/v1/completions", json=dict(body, max_tokens=12)).text.splitlines()
                if ln.startswith("data: ")
            ]
        assert lines[-1] == "data: [DONE]"
        assert "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]) == want["geometry"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert _tree(adapter_dir) == before


# ---- hot load / unload under load ------------------------------------------------------------------------
CLIENTS, PER_CLIENT, MAX_TOKENS = 32, 3, 8


@pytest.fixture(scope="module")
def churned(tmp_path_factory):
    root = tmp_path_factory.mktemp("hot-adapters")
    pm = add_adapter(load_pretrained(BASE), Placement("decoder-half", ("all-linear",)), AdapterConfig(rank=4))
    randomize_adapter(pm, 0.05, seed=11)
    save_adapter(pm, root / "hot")
    server = build_server(
        BASE,
        {"geometry": SHIPPED},
        engine_options=EngineOptions(max_seqs=8, max_batch_tokens=256, max_seq_len=128),
        max_queue=32,
        max_tokens_limit=16,
        adapter_dir=root,
    )
    with live_uvicorn(server.app) as port:
        yield {"server": server, "url": f"http://127.0.0.1:{port}"}


def _request(http: httpx.Client, url: str, model: str, prompt: str, chat: bool, stream: bool):
    """(status, text or None, finish reason or None, the documented error's type)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    if not stream:
        r = http.post(url + path, json=body)
        if r.status_code != 200:
            return r.status_code, None, None, r.json()["error"]["type"]
        choice = r.json()["choices"][0]
        return 200, choice["message"]["content"] if chat else choice["text"], choice["finish_reason"], None
    with http.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None, None, r.json()["error"]["type"]
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("error" not in c for c in chunks), chunks
    text = "".join((c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"] for c in chunks)
    return 200, text, chunks[-1]["choices"][0]["finish_reason"], None


def test_load_and_unload_while_32_clients_run(churned):
    url, server = churned["url"], churned["server"]
    worker = server.worker
    load = {"lora_name": "hot", "lora_path": "hot"}
    with httpx.Client(timeout=60) as http:
        assert http.post(url + "/v1/load_lora_adapter", json=load).status_code == 200
        # each request's text alone (greedy), before any churn
        want = {
            (m, p, chat): _request(http, url, m, p, chat, False)[1]
            for m in (NAME, "geometry", "hot")
            for p in PROMPTS
            for chat in (False, True)
        }
        assert len({want[(m, PROMPTS[0], False)] for m in (NAME, "geometry", "hot")}) == 3
        assert http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "hot"}).status_code == 200

    schema = httpx.get(url + "/openapi.json").json()
    results, errors, ops = [], [], []
    lock, done = threading.Lock(), threading.Event()
    go = threading.Barrier(CLIENTS + 1)

    def client(i: int) -> None:
        rng = random.Random(i)
        try:
            with httpx.Client(timeout=60) as http:
                go.wait()
                for k in range(PER_CLIENT):
                    model = ("hot", "geometry", NAME)[(i + k) % 3]
                    prompt, chat, stream = rng.choice(PROMPTS), rng.random() < 0.5, rng.random() < 0.5
                    status, text, reason, kind = _request(http, url, model, prompt, chat, stream)
                    with lock:
                        results.append((model, prompt, chat, stream, status, text, reason, kind))
        except Exception as exc:  # a hang (ReadTimeout), a broken stream, a bad body
            with lock:
                errors.append(f"client {i}: {type(exc).__name__}: {exc}")

    def churn() -> None:
        """Load, unload (refused while busy: then with wait), load again, ... until the clients are done."""
        with httpx.Client(timeout=60) as http:
            go.wait()
            n = 0
            while not done.is_set() or n < 4:
                n += 1
                if n % 2:
                    r = http.post(url + "/v1/load_lora_adapter", json=load)
                    ops.append(("load", r.status_code))
                else:
                    r = http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "hot", "wait": n % 4 == 0})
                    ops.append(("unload-wait" if n % 4 == 0 else "unload", r.status_code))
                assert r.status_code in (200, 404, 409), r.text
                op = schema["paths"][str(r.request.url.path)]["post"]["responses"]
                assert str(r.status_code) in op
                time.sleep(0.25 if n % 2 and r.status_code == 200 else 0.05)  # loaded a while: some requests use it

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    churner = threading.Thread(target=churn)
    for t in (*threads, churner):
        t.start()
    start = time.monotonic()
    for t in threads:
        t.join(300)
    done.set()
    churner.join(120)
    took = time.monotonic() - start
    assert not any(t.is_alive() for t in (*threads, churner)), "a client or the churn hung"
    assert errors == []
    assert len(results) == CLIENTS * PER_CLIENT

    statuses: dict = {}
    for model, prompt, chat, stream, status, text, reason, kind in results:
        statuses[status] = statuses.get(status, 0) + 1
        path = "/v1/chat/completions" if chat else "/v1/completions"
        assert str(status) in schema["paths"][path]["post"]["responses"], status
        if status == 200:  # completed, with the text it gets alone
            assert reason in ("length", "stop") and text == want[(model, prompt, chat)], (model, prompt, chat, stream)
        elif model == "hot":  # refused cleanly: not loaded at that moment, or being unloaded
            assert (status, kind) in ((404, "not_found_error"), (409, "invalid_request_error")), (status, kind)
        else:
            assert status == 429 and kind == "rate_limit_error", (model, status, kind)
    hot_ok = sum(1 for r in results if r[0] == "hot" and r[4] == 200)
    assert hot_ok > 0 and statuses[200] >= 2 * CLIENTS * PER_CLIENT // 3, statuses  # base and geometry all served
    assert ("load", 200) in ops and any(op.startswith("unload") and s == 200 for op, s in ops), ops

    deadline = time.monotonic() + 30
    while worker.in_flight or worker.engine.has_unfinished():
        assert time.monotonic() < deadline, f"{worker.in_flight} requests still in flight"
        time.sleep(0.05)
    assert worker.errors == 0 and worker.alive
    # what the HTTP side lists is what the engine holds (after draining unloads too)
    deadline = time.monotonic() + 10
    while set(worker.adapters) != set(server.engine.adapters.adapters):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    listed = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert listed == [NAME, *server.engine.adapters.adapters]
    print(
        f"{len(results)} requests in {took:.1f} s: statuses {statuses}, hot served {hot_ok}; "
        f"{len(ops)} load/unload calls: {sorted(set(ops))}"
    )
