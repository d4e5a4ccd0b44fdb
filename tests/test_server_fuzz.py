"""A schema-driven fuzz of every endpoint of the server with schemathesis (its CLI, its default checks and
phases), from the server's own ``/openapi.json``: 0 server errors, 0 status codes or content types the schema
does not document, every response body matching its schema, schema-valid requests accepted and invalid ones
refused, 0 hung requests (each request has a timeout; the engine ends with nothing in flight).

The server is the real one (uvicorn on a free loopback port, in this process) over the shipped causal
encoder-decoder with the shipped geometry adapter, ``--adapter-dir`` set (so loading over HTTP is on). Its
context (512) leaves room for ``max_tokens_limit`` (4) after the longest prompt it takes (``max_prompt_tokens``
= 508), which the schema states for token-id prompts. A text prompt's length in tokens is the one limit the
schema cannot state: ``fuzz_hooks`` keeps generated text prompts within it (by their UTF-8 bytes), and
filters nothing else.

Marked ``fuzz`` (about a minute on two cores): ``make test`` leaves it out, ``.ci/run`` runs it
(``pytest -m fuzz``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from factories import live_uvicorn

pytest.importorskip("schemathesis")

from kvgraft.runtime.options import EngineOptions
from kvgraft.serve.server import build_server  # noqa: E402

pytestmark = pytest.mark.fuzz

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "models" / "kvgraft-ced-8m"
ADAPTER = ROOT / "models" / "adapters" / "kvgraft-ced-8m-geometry"
MAX_LEN, MAX_TOKENS = 512, 4
EXAMPLES = 100  # per operation and phase
OPERATIONS = {
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("GET", "/health"),
    ("GET", "/metrics"),
}


class _Record:
    """ASGI wrapper that notes (method, path, status, content type) of every response."""

    def __init__(self, app) -> None:
        self.app, self.seen, self._lock = app, [], threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def note(message):
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers") or ()).get(b"content-type", b"").decode()
                with self._lock:
                    self.seen.append((scope["method"], scope["path"], message["status"], ctype.split(";")[0]))
            await send(message)

        await self.app(scope, receive, note)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    adapter_dir = tmp_path_factory.mktemp("adapter-dir")
    shutil.copytree(ADAPTER, adapter_dir / "geometry")
    server = build_server(
        BASE,
        {"geometry": ADAPTER},
        engine_options=EngineOptions(max_seqs=4, max_batch_tokens=512, max_seq_len=MAX_LEN),
        max_tokens_limit=MAX_TOKENS,
        max_prompt_tokens=MAX_LEN - MAX_TOKENS,
        adapter_dir=adapter_dir,
    )
    record = _Record(server.app)
    with live_uvicorn(record, log_level="critical", lifespan="on") as port:
        yield {"server": server, "url": f"http://127.0.0.1:{port}", "record": record}


def test_schemathesis_finds_nothing(fuzzed, tmp_path):
    url, server, record = fuzzed["url"], fuzzed["server"], fuzzed["record"]
    report = tmp_path / "report"
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        url + "/openapi.json",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        "20261202",
        "--request-timeout",
        "30",
        "--report",
        "json",
        "--report-dir",
        str(report),
        "--output-sanitize",
        "false",
        "--output-truncate",
        "false",
    ]
    env = dict(
        os.environ,
        SCHEMATHESIS_HOOKS="fuzz_hooks",
        KVGRAFT_FUZZ_MAX_PROMPT_BYTES=str(MAX_LEN - MAX_TOKENS),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    start = time.monotonic()
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    took = time.monotonic() - start
    out = run.stdout[-20000:] + run.stderr[-4000:]
    result = json.loads(next(report.glob("*.json")).read_text())
    assert run.returncode == 0 and result["exit_code"] == 0, out
    assert result["failures"] == [] and result["errors"] == [], out  # errors include timed-out (hung) requests
    assert result["operations"]["tested"] == len(OPERATIONS) and result["complete"], out
    assert result["test_cases"]["generated"] >= 700, out

    # what the server answered, seen from inside: every status and content type documented for its operation
    schema = httpx.get(url + "/openapi.json").json()
    seen = list(record.seen)
    assert len(seen) >= result["test_cases"]["generated"]
    statuses: dict[tuple[str, str], set[int]] = {}
    others: set = set()
    for method, path, status, ctype in seen:
        assert status < 500, (method, path, status)
        if path == "/openapi.json":
            continue
        op = schema["paths"].get(path, {}).get(method.lower())
        if op is None:  # probes of other methods (or paths): 405/404 in the error shape
            assert status in (404, 405), (method, path, status)
            others.add((method, path, status))
            continue
        documented = op["responses"].get(str(status))
        assert documented is not None, (method, path, status)
        assert ctype in documented.get("content", {}), (method, path, status, ctype)
        statuses.setdefault((method, path), set()).add(status)
    # the fuzz reached the model, streaming or not, and the refusals
    assert {200, 400} <= statuses[("POST", "/v1/completions")], statuses
    assert {200, 400} <= statuses[("POST", "/v1/chat/completions")], statuses
    kinds = {c for m, p, s, c in seen if p == "/v1/completions" and s == 200}
    assert kinds == {"application/json", "text/event-stream"}, kinds
    # nothing hung or leaked in the engine
    worker = server.worker
    deadline = time.monotonic() + 30
    while worker.in_flight or worker.engine.has_unfinished():
        assert time.monotonic() < deadline, f"{worker.in_flight} requests still in flight after the fuzz"
        time.sleep(0.05)
    assert worker.errors == 0 and worker.alive
    assert httpx.get(url + "/health").json()["status"] == "ok"
    print(
        f"schemathesis: {result['test_cases']['generated']} test cases, {len(seen)} requests in {took:.1f} s; "
        f"statuses {sorted((f'{m} {p}', sorted(s)) for (m, p), s in statuses.items())}; other probes {sorted(others)}"
    )
