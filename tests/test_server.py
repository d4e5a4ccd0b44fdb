"""The OpenAI-compatible server end to end: a live uvicorn server on 127.0.0.1 over the shipped causal
encoder-decoder with two random adapters, driven by the official ``openai`` client (and httpx for raw
HTTP). Text equals the engine's own greedy output for the same request; errors are 400/403/404/405/409/
411/413/422/429/503, each documented for its endpoint in /openapi.json with its content type and the
ErrorResponse body; a client that disconnects cancels its request. (The kill -9 and hot-load-under-load
checks are in test_server_abuse.py, the schemathesis fuzz in test_server_fuzz.py.)"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from factories import live_uvicorn

from kvgraft.adapters.lora import AdapterConfig, add_adapter, randomize_adapter, save_adapter
from kvgraft.adapters.placement import Placement
from kvgraft.hf import load_pretrained, load_tokenizer_dir
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams
from kvgraft.serve.server import CHAT_STOP, build_server, render_chat

BASE = Path(__file__).resolve().parents[1] / "models" / "kvgraft-ced-8m"
NAME = "kvgraft-ced-8m"
MAX_SEQS, MAX_QUEUE, MAX_LEN = 2, 1, 128


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    base = load_pretrained(BASE)
    specs = {"dec": Placement("decoder-half", ("all-linear",)), "enc": Placement("encoder-half", ("attention",))}
    for i, (name, placement) in enumerate(specs.items()):
        pm = add_adapter(copy.deepcopy(base), placement, AdapterConfig(rank=4))
        randomize_adapter(pm, 0.05, seed=i)
        save_adapter(pm, root / name)
    (root / "extra").mkdir()
    pm = add_adapter(copy.deepcopy(base), Placement("from:6", ("mlp",)), AdapterConfig(rank=2))
    randomize_adapter(pm, 0.05, seed=7)
    save_adapter(pm, root / "extra" / "mlp")
    server = build_server(
        BASE,
        {n: root / n for n in specs},
        engine_options=EngineOptions(max_seqs=MAX_SEQS, max_batch_tokens=64, max_seq_len=MAX_LEN),
        max_queue=MAX_QUEUE,
        max_tokens_limit=64,
        max_request_bytes=4096,
        adapter_dir=root / "extra",
    )
    with live_uvicorn(server.app, start_timeout=30) as port:
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield {"server": server, "url": url, "client": client, "root": root}


_reference: dict = {}


def engine_text(live, prompt_ids, adapter, max_tokens, stops=()) -> tuple[str, str]:
    """(text, finish reason) the engine itself gives for the request, greedy, on a fresh copy of the base."""
    if "engine" not in _reference:
        tok = load_tokenizer_dir(BASE)
        engine = Engine(
            load_pretrained(BASE),
            EngineOptions(max_seqs=1, max_seq_len=MAX_LEN),
            detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
        )
        for name in ("dec", "enc"):
            engine.load_adapter(name, live["root"] / name)
        engine.load_adapter("mlp", live["root"] / "extra" / "mlp")
        _reference.update(engine=engine, tok=tok)
    engine, tok = _reference["engine"], _reference["tok"]
    eos = engine.model.config.eos_token_id
    rid = engine.add_request(
        prompt_ids, SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(eos,), stop=tuple(stops)), adapter=adapter
    )
    engine.run()
    req = engine.pop_finished(rid)
    text = tok.decode(req.output, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s in text]
    return (text[: min(cuts)] if cuts else text), req.finish_reason


PROMPT = "The package provides"


def test_completions_and_chat_equal_the_engine_streaming_or_not(live):
    client, tok = live["client"], live["server"].tokenizer
    ids = tok.encode(PROMPT)
    seen = set()
    for model, adapter in ((NAME, None), ("dec", "dec"), ("enc", "enc")):
        want, reason = engine_text(live, ids, adapter, 12)
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, reason)
        assert r.model == model and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 12
        chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == reason
        seen.add(want)
    assert len(seen) == 3  # each adapter changes the text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a package?"}]
    chat_ids = tok.encode(render_chat(messages))
    for model, adapter in ((NAME, None), ("dec", "dec")):
        want, reason = engine_text(live, chat_ids, adapter, 10, stops=(CHAT_STOP,))
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, reason)
        chunks = list(
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].usage.prompt_tokens == len(chat_ids)
    # a stop string is cut from the text, and token-id prompts work
    text, _ = engine_text(live, ids, "dec", 12)
    stop = text[3:6]
    want, reason = engine_text(live, ids, "dec", 12, stops=(stop,))
    r = client.completions.create(model="dec", prompt=ids, max_tokens=12, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop") and stop not in want
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="dec", prompt=ids, max_tokens=12, temperature=0, stop=[stop], stream=True)
    )
    assert streamed == want


def documented(live, method: str, path: str, r: httpx.Response) -> httpx.Response:
    """``r``'s status and content type are documented for the operation in the server's /openapi.json, and an
    error's body is an ErrorResponse whose code is the status (/health's 503 is its own report)."""
    if "openapi" not in live:
        live["openapi"] = httpx.get(live["url"] + "/openapi.json").json()
    schema = live["openapi"]
    responses = schema["paths"][path][method.lower()]["responses"]
    assert str(r.status_code) in responses, f"{method} {path}: {r.status_code} is not documented ({sorted(responses)})"
    content = responses[str(r.status_code)].get("content", {})
    ctype = r.headers["content-type"].split(";")[0].strip()
    assert ctype in content, f"{method} {path} {r.status_code}: {ctype} is not documented ({sorted(content)})"
    if r.status_code >= 400 and path == "/health":  # the health report, 503 or not
        assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/Health"}
        assert r.json()["status"] != "ok"
    elif r.status_code >= 400:
        assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["code"] == r.status_code and isinstance(body["error"]["message"], str)
    return r


def test_models_health_and_metrics(live):
    client, url = live["client"], live["url"]
    models = client.models.list().data
    assert [m.id for m in models] == [NAME, "dec", "enc"]
    for path in ("/v1/models", "/health", "/metrics"):
        documented(live, "GET", path, httpx.get(url + path))
    info = models[1].model_extra["kvgraft"]
    assert info["certificate"]["first_adapted_layer"] == 4 and info["rank"] == 4
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["adapters"] == ["dec", "enc"]
    metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for name in (
        "kvgraft_queue_depth",
        "kvgraft_running_requests",
        "kvgraft_tokens_per_second",
        "kvgraft_generated_tokens_total",
        "kvgraft_adapters_loaded 2.0",
        "kvgraft_prefix_cache_entries",
        "kvgraft_prefix_cache_hit_rate",
        "kvgraft_prefix_cache_hits_total",
        "kvgraft_prefix_cache_queries_total",
        "kvgraft_decoder_replays_total",
    ):
        assert name in metrics.text
    # the cache gauges are the engine's own cache_stats(), read by the engine thread between steps
    server = live["server"]
    want = server.engine.cache_stats()
    deadline = time.monotonic() + 5
    while True:
        values = _metric_values(httpx.get(url + "/metrics").text)
        got = {k: values[f'kvgraft_cache_bytes{{kind="{k}"}}'] for k in ("used", "free", "total", "shared", "private")}
        if got == {k: float(want[f"{k}_bytes"]) for k in got} or time.monotonic() > deadline:
            break
        time.sleep(0.05)
        want = server.engine.cache_stats()  # idle: the worker refreshes its snapshot within 0.2 s
    assert got == {k: float(want[f"{k}_bytes"]) for k in got}
    assert got["total"] == server.engine.cache.nbytes > 0 and got["used"] + got["free"] == got["total"]
    assert got["shared"] + got["private"] == got["used"]
    assert values["kvgraft_prefix_cache_entries"] == want["prefix_entries"]
    assert values["kvgraft_prefix_cache_hits_total"] == want["prefix_hits"]
    assert values["kvgraft_prefix_cache_queries_total"] == want["prefix_queries"]
    assert values["kvgraft_prefix_cache_hit_rate"] == pytest.approx(want["prefix_hit_rate"])
    assert values["kvgraft_decoder_replays_total"] == want["replays"]


def _metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comment lines skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_errors_are_openai_shaped_and_documented(live):
    client, url = live["client"], live["url"]
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    with pytest.raises(
        openai.NotFoundError,
        match=r"model 'nope' not found; served: base 'kvgraft-ced-8m', "
        r"adapters: dec, enc",
    ) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    documented(live, "POST", cmpl, e.value.response)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(65\) exceeds this server's limit \(64\)") as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=65)
    documented(live, "POST", cmpl, e.value.response)
    with pytest.raises(
        openai.BadRequestError,
        match=r"prompt \(\d+ tokens\) \+ max_tokens \(64\) exceeds the model's "
        r"context \(128 tokens\)",
    ) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * 80}], max_tokens=64)
    documented(live, "POST", chat, e.value.response)
    with pytest.raises(openai.BadRequestError, match="the prompt has 200 tokens; this server takes at most 127"):
        client.completions.create(model=NAME, prompt=[1] * 200, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, n=2)
    with pytest.raises(openai.BadRequestError, match="temperature: Input should be greater than or equal to 0"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=-1)
    # max_tokens is checked even when max_completion_tokens is the one used
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(65\) exceeds this server's limit") as e:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=65, max_completion_tokens=1
        )
    documented(live, "POST", chat, e.value.response)
    # types are strict, as the schema says ("1" is not 1), but 1.0 is JSON Schema's integer 1
    r = documented(live, "POST", cmpl, httpx.post(url + cmpl, json={"model": NAME, "prompt": PROMPT, "max_tokens": "2"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = documented(
        live, "POST", cmpl, httpx.post(url + cmpl, json={"model": NAME, "prompt": PROMPT, "max_tokens": 2.0, "temperature": 0})
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    # a lone surrogate (valid JSON) in a prompt or message: 400, not a tokenizer crash
    for path, body in (
        (cmpl, {"model": NAME, "prompt": "a\ud800b"}),
        (chat, {"model": NAME, "messages": [{"role": "user", "content": "a\ud800b"}]}),
    ):
        r = documented(
            live,
            "POST",
            path,
            httpx.post(url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}),
        )
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"]
    # the body limit (413), a body without Content-Length (411), not JSON (400)
    r = documented(live, "POST", cmpl, httpx.post(url + cmpl, json={"model": NAME, "prompt": "x" * 5000}))
    assert r.status_code == 413 and "exceeds this server's limit (4096 bytes)" in r.json()["error"]["message"]
    r = documented(
        live,
        "POST",
        cmpl,
        httpx.post(url + cmpl, content=iter([b'{"model": "x"}']), headers={"content-type": "application/json"}),
    )
    assert r.status_code == 411 and "Content-Length" in r.json()["error"]["message"]
    r = documented(live, "POST", cmpl, httpx.post(url + cmpl, content=b"{not json", headers={"content-type": "application/json"}))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid request")
    # another method, or no such path: the same error shape
    r = httpx.get(url + cmpl)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405
    r = httpx.get(url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # FastAPI's 422 is not documented: validation errors are 400 here
    assert all("422" not in op["responses"] for op in live["openapi"]["paths"]["/v1/completions"].values())


def test_tiny_temperature_top_p_and_huge_seeds_are_served(live):
    """Schema-valid sampling values that once failed the engine's step (500 for every running request):
    temperature and top_p that round to 0 in float32, a seed over 2**64."""
    client = live["client"]
    want, _ = engine_text(live, live["server"].tokenizer.encode(PROMPT), None, 4)
    for kwargs in (
        {"temperature": 5e-324},
        {"temperature": 1e-300, "seed": 3},
        {"top_p": 5e-324, "temperature": 1.0},
        {"temperature": 0.7, "seed": 2**70},
    ):
        r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, **kwargs)
        assert r.choices[0].finish_reason in ("length", "stop")
        if kwargs.get("temperature", 1) < 1e-6 or kwargs.get("top_p", 1) < 1e-6:  # greedy in the limit
            assert r.choices[0].text == want
    assert live["server"].worker.errors == 0


def test_a_stopped_engine_answers_503_at_once(live):
    """A server whose engine is not running (never started here) answers 503 everywhere, documented, and
    never leaves a request waiting."""
    from fastapi.testclient import TestClient

    from kvgraft.serve.server import KvgraftServer

    base = live["server"]
    stopped = KvgraftServer(base.engine, base.tokenizer, base.config)  # its worker is never started
    http = TestClient(stopped.app)  # no lifespan: the engine thread does not run
    cases = [
        ("GET", "/health", None),
        ("POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "dec"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "mlp2", "lora_path": "mlp"}),
    ]
    for method, path, body in cases:
        start = time.monotonic()
        r = http.request(method, path, json=body)
        assert time.monotonic() - start < 5
        assert r.status_code == 503, (path, r.status_code, r.text)
        documented(live, method, path, r)


def test_a_full_queue_answers_429(live):
    client, worker = live["client"], live["server"].worker
    worker.pause()
    try:
        with concurrent.futures.ThreadPoolExecutor(MAX_SEQS + MAX_QUEUE) as pool:
            futures = [
                pool.submit(client.completions.create, model=m, prompt=PROMPT, max_tokens=3, temperature=0)
                for m in (NAME, "dec", "enc")[: MAX_SEQS + MAX_QUEUE]
            ]
            deadline = time.monotonic() + 20
            while worker.in_flight < MAX_SEQS + MAX_QUEUE:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(openai.RateLimitError, match="queue is full") as e:
                client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3)
            documented(live, "POST", "/v1/completions", e.value.response)
            worker.resume()
            assert all(len(f.result(timeout=60).choices[0].text) > 0 for f in futures)
    finally:
        worker.resume()
    assert 'kvgraft_requests_total{outcome="rejected"} 1.0' in httpx.get(live["url"] + "/metrics").text


def test_a_client_that_disconnects_cancels_its_request(live):
    worker = live["server"].worker
    before = worker.counts["cancelled"]
    body = {"model": "dec", "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", live["url"] + "/v1/completions", json=body) as r:
        documented(live, "POST", "/v1/completions", r)  # 200 text/event-stream
        for line in r.iter_lines():
            if line.startswith("data: "):
                worker.pause()  # the request is running and will not finish while we go away
                break
    try:
        deadline = time.monotonic() + 10
        while worker.counts["cancelled"] == before or worker.in_flight:
            assert time.monotonic() < deadline, "the request was not cancelled"
            time.sleep(0.02)
        assert not worker.engine.has_unfinished()  # its blocks are freed
    finally:
        worker.resume()
    # non-streaming: the client times out and goes away
    worker.pause()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live["url"] + "/v1/completions", json=dict(body, stream=False), timeout=0.5)
        deadline = time.monotonic() + 10
        while worker.counts["cancelled"] < before + 2 or worker.in_flight:
            assert time.monotonic() < deadline, "the request was not cancelled"
            time.sleep(0.02)
    finally:
        worker.resume()


def test_adapters_load_and_unload_over_http(live, monkeypatch):
    client, url, tok = live["client"], live["url"], live["server"].tokenizer
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"

    def post(path, body):
        return documented(live, "POST", path, httpx.post(url + path, json=body, timeout=30))

    r = post(load, {"lora_name": "mlp", "lora_path": "mlp"})
    assert r.status_code == 200 and r.json()["loaded"] == "mlp"
    want, _ = engine_text(live, tok.encode(PROMPT), "mlp", 8)
    assert client.completions.create(model="mlp", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text == want
    assert post(load, {"lora_name": "mlp", "lora_path": "mlp"}).status_code == 409
    assert post(load, {"lora_name": NAME, "lora_path": "mlp"}).status_code == 409  # the base's name
    r = post(load, {"lora_name": "bad name", "lora_path": "mlp"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    for escape in ("../dec", str(live["root"] / "dec"), "../../../etc"):
        r = post(load, {"lora_name": "x", "lora_path": escape})
        assert r.status_code == 403 and "outside the adapter directory" in r.json()["error"]["message"]
    for missing in ("missing", "", "a\x00b", "x" * 3000):  # the directory itself is no adapter either
        r = post(load, {"lora_name": "x", "lora_path": missing})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path", r.json()
    assert "is not a directory" in post(load, {"lora_name": "x", "lora_path": "missing"}).json()["error"]["message"]
    broken = live["root"] / "extra" / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "adapter_config.json").write_text("{}")
    r = post(load, {"lora_name": "x", "lora_path": "broken"})  # PEFT's files alone: no kvgraft metadata
    assert r.status_code == 422 and "has no kvgraft_adapter.json" in r.json()["error"]["message"]
    (broken / "kvgraft_adapter.json").write_text("{not json")
    r = post(load, {"lora_name": "x", "lora_path": "broken"})
    assert r.status_code == 422 and "not valid JSON" in r.json()["error"]["message"]
    r = post(unload, {"lora_name": "mlp"})
    assert r.json() == {"unloaded": "mlp", "draining": None}
    r = post(unload, {"lora_name": "mlp"})
    assert r.status_code == 404 and "loaded adapters: dec, enc" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp", prompt=PROMPT, max_tokens=2)
    assert [m.id for m in client.models.list().data] == [NAME, "dec", "enc"]
    monkeypatch.setattr(live["server"].config, "adapter_dir", None)  # loading over HTTP off
    r = post(load, {"lora_name": "mlp", "lora_path": "mlp"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


def test_an_adapter_unloading_refuses_new_requests_then_goes(live):
    """unload with wait: the running request finishes, new ones get 409 meanwhile, and once it is gone
    /v1/models and /health no longer list it (it was reaped inside a step, not by an HTTP call)."""
    client, url, worker = live["client"], live["url"], live["server"].worker
    post = lambda path, body: documented(live, "POST", path, httpx.post(url + path, json=body, timeout=30))  # noqa: E731
    assert post("/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": "mlp"}).status_code == 200
    worker.pause()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(client.completions.create, model="mlp", prompt=PROMPT, max_tokens=4, temperature=0)
            deadline = time.monotonic() + 20
            while worker.in_flight < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = post("/v1/unload_lora_adapter", {"lora_name": "mlp"})
            assert r.status_code == 409 and "unfinished requests" in r.json()["error"]["message"]
            r = post("/v1/unload_lora_adapter", {"lora_name": "mlp", "wait": True})
            assert r.json() == {"unloaded": None, "draining": "mlp"}
            r = post("/v1/completions", {"model": "mlp", "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 409 and "being unloaded" in r.json()["error"]["message"]
            r = post("/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": "mlp"})
            assert r.status_code == 409
            worker.resume()
            assert running.result(timeout=60).choices[0].finish_reason in ("length", "stop")
    finally:
        worker.resume()
    deadline = time.monotonic() + 10
    while "mlp" in httpx.get(url + "/health").json()["adapters"]:
        assert time.monotonic() < deadline, "the unloaded adapter is still listed"
        time.sleep(0.05)
    assert [m.id for m in client.models.list().data] == [NAME, "dec", "enc"]
    r = post("/v1/completions", {"model": "mlp", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404


def test_kvgraft_serve_checks_its_arguments_before_loading(capsys):
    from kvgraft.cli import main

    assert main(["serve", NAME, "--adapter", "no-equals-sign"]) == 2
    assert "--adapter 'no-equals-sign' must be NAME=PATH" in capsys.readouterr().err
    assert main(["serve", NAME, "--adapter", "a=x", "--adapter", "a=y"]) == 2
    assert "names 'a' twice" in capsys.readouterr().err
    assert main(["serve", NAME, "--port", "70000"]) == 2
    assert "--port (70000)" in capsys.readouterr().err


def test_kvgraft_serve_passes_its_options_to_build_server(monkeypatch, capsys):
    import kvgraft.cli.cmd.serve as command  # the names `kvgraft serve` calls
    from kvgraft.cli import main

    seen = []

    class Fake:
        config = type("C", (), {"model_name": NAME})()
        engine = type(
            "E", (), {"adapters": type("R", (), {"adapters": {}})(), "pool": "KV cache budget (fake)", "packed_linears": 0}
        )()

    def fake_build(model, adapters, *, engine_options, **kwargs):  # the engine's options flattened beside the rest
        seen.append((model, adapters, dataclasses.asdict(engine_options) | kwargs))
        return Fake()

    monkeypatch.setattr(command, "build_server", fake_build)
    monkeypatch.setattr(command, "run_server", lambda *a, **k: None)
    assert main(["serve", NAME, "--adapter", "a=x", "--max-seqs", "3"]) == 0
    assert main(["serve", NAME, "--no-prefix-cache", "--no-shipped-adapters"]) == 0
    (m1, a1, k1), (_, a2, k2) = seen
    assert (m1, a1, k1["max_seqs"], k1["prefix_cache"]) == (NAME, {"a": "x"}, 3, True)
    assert (a2, k2["prefix_cache"]) == ({}, False)
    assert k1["with_shipped_adapters"] and not k2["with_shipped_adapters"]  # shipped adapters: on by default
    assert k1["kv_budget"] is None and k1["max_seq_len"] is None and k1["dtype"] is None  # the engine's defaults
    assert not k1["prefault"]  # pools mapped on first write unless asked
    assert main(["serve", NAME, "--prefault"]) == 0 and seen[-1][2]["prefault"] is True
    out = capsys.readouterr().out
    assert "serving kvgraft-ced-8m" in out and "KV cache budget (fake)" in out  # the pool is printed at start


def test_build_server_passes_prefix_cache_to_the_engine():
    on = build_server(BASE, engine_options=EngineOptions(max_seqs=1, max_seq_len=64))
    off = build_server(BASE, engine_options=EngineOptions(max_seqs=1, max_seq_len=64, prefix_cache=False))
    assert on.engine.prefix is not None and off.engine.prefix is None


def test_the_shipped_geometry_adapter_is_served_out_of_the_box():
    """models/adapters/kvgraft-ced-8m-geometry: small, portable (no machine's path), shares the cache per its
    certificate, refused nowhere on its base; build_server(with_shipped_adapters=True) serves it beside the
    base (and finds nothing for another base)."""
    from kvgraft.adapters.lora import load_adapter
    from kvgraft.serve.server import shipped_adapters

    shipped = BASE.parent / "adapters" / "kvgraft-ced-8m-geometry"
    sizes = {p.name: p.stat().st_size for p in shipped.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "kvgraft_adapter.json", "README.md"} <= set(sizes)
    assert sum(sizes.values()) < 2_000_000
    meta = json.loads((shipped / "kvgraft_adapter.json").read_text())
    assert meta["base"]["name"] == NAME and meta["base"]["reference"] is True
    assert meta["certificate"]["shares_cache"] is True and meta["placement"]["freeze_kv_writers"] is True
    for name in ("kvgraft_adapter.json", "adapter_config.json", "training.json"):
        text = (shipped / name).read_text()
        assert str(Path.home()) not in text and "/tmp/" not in text and str(BASE.parents[1]) not in text, name
    load_adapter(load_pretrained(BASE), shipped)  # the weights fingerprint matches the shipped base

    server = build_server(BASE, with_shipped_adapters=True, engine_options=EngineOptions(max_seqs=2, max_seq_len=64))
    assert [m["id"] for m in server.models()["data"]] == [NAME, "kvgraft-ced-8m-geometry"]
    ids = server.tokenizer.encode("Q: A square has side 7. Area?\nA:")
    out = server.engine.generate([ids, ids], SamplingParams(max_new_tokens=8), adapters=[None, "kvgraft-ced-8m-geometry"])
    assert out[0] != out[1]
    given = build_server(
        BASE, {"geo": shipped}, with_shipped_adapters=True, engine_options=EngineOptions(max_seqs=1, max_seq_len=64)
    )
    assert list(given.worker.adapters) == ["geo"]  # not twice under two names
    llama = BASE.parent / "kvgraft-llama-8m"
    assert shipped_adapters(llama, load_pretrained(llama).config) == {}
