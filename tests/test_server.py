"""The OpenAI-compatible server end to end: a live uvicorn server on 127.0.0.1 over the shipped causal
encoder-decoder with two random adapters, driven by the official ``openai`` client (and httpx for raw
HTTP). Text equals the engine's own greedy output for the same request; errors are 404/400/409/429;
a client that disconnects cancels its request."""

from __future__ import annotations

import concurrent.futures
import copy
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from kvgraft.adapters.lora import AdapterConfig, add_adapter, randomize_adapter, save_adapter
from kvgraft.adapters.placement import Placement
from kvgraft.hf import load_pretrained, load_tokenizer_dir
from kvgraft.serve.engine import Engine
from kvgraft.serve.sampling import SamplingParams
from kvgraft.serve.server import CHAT_STOP, build_server, render_chat

BASE = Path(__file__).resolve().parents[1] / "models" / "kvgraft-ced-8m"
NAME = "kvgraft-ced-8m"
MAX_SEQS, MAX_QUEUE, MAX_LEN = 2, 1, 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    server = build_server(BASE, {n: root / n for n in specs}, max_seqs=MAX_SEQS, max_batch_tokens=64,
                          max_seq_len=MAX_LEN, max_queue=MAX_QUEUE, max_tokens_limit=64, max_request_bytes=4096,
                          adapter_dir=root / "extra")
    port = _free_port()
    userver = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=userver.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not userver.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield {"server": server, "url": url, "client": client, "root": root}
    userver.should_exit = True
    thread.join(10)


_reference: dict = {}


def engine_text(live, prompt_ids, adapter, max_tokens, stops=()) -> tuple[str, str]:
    """(text, finish reason) the engine itself gives for the request, greedy, on a fresh copy of the base."""
    if "engine" not in _reference:
        tok = load_tokenizer_dir(BASE)
        engine = Engine(load_pretrained(BASE), max_seqs=1, max_seq_len=MAX_LEN,
                        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True))
        for name in ("dec", "enc"):
            engine.load_adapter(name, live["root"] / name)
        engine.load_adapter("mlp", live["root"] / "extra" / "mlp")
        _reference.update(engine=engine, tok=tok)
    engine, tok = _reference["engine"], _reference["tok"]
    eos = engine.model.config.eos_token_id
    rid = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(eos,),
                                                        stop=tuple(stops)), adapter=adapter)
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
        chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].usage.prompt_tokens == len(chat_ids)
    # a stop string is cut from the text, and token-id prompts work
    text, _ = engine_text(live, ids, "dec", 12)
    stop = text[3:6]
    want, reason = engine_text(live, ids, "dec", 12, stops=(stop,))
    r = client.completions.create(model="dec", prompt=ids, max_tokens=12, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop") and stop not in want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="dec", prompt=ids, max_tokens=12, temperature=0, stop=[stop], stream=True))
    assert streamed == want


def test_models_health_and_metrics(live):
    client, url = live["client"], live["url"]
    models = client.models.list().data
    assert [m.id for m in models] == [NAME, "dec", "enc"]
    info = models[1].model_extra["kvgraft"]
    assert info["certificate"]["first_adapted_layer"] == 4 and info["rank"] == 4
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["adapters"] == ["dec", "enc"]
    metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for name in ("kvgraft_queue_depth", "kvgraft_running_requests", "kvgraft_tokens_per_second",
                 "kvgraft_generated_tokens_total", "kvgraft_adapters_loaded 2.0", "kvgraft_prefix_cache_entries",
                 "kvgraft_prefix_cache_hit_rate", "kvgraft_prefix_cache_hits_total",
                 "kvgraft_prefix_cache_queries_total", "kvgraft_decoder_replays_total"):
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


def test_errors_are_openai_shaped(live):
    client, url = live["client"], live["url"]
    with pytest.raises(openai.NotFoundError, match=r"model 'nope' not found; served: base 'kvgraft-ced-8m', "
                                                   r"adapters: dec, enc"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(65\) exceeds this server's limit \(64\)"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=65)
    with pytest.raises(openai.BadRequestError, match=r"prompt \(\d+ tokens\) \+ max_tokens \(64\) exceeds the model's "
                                                     r"context \(128 tokens\)"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * 80}], max_tokens=64)
    with pytest.raises(openai.BadRequestError, match="the prompt has 200 tokens; this server takes at most 127"):
        client.completions.create(model=NAME, prompt=[1] * 200, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, n=2)
    with pytest.raises(openai.BadRequestError, match="temperature: Input should be greater than or equal to 0"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=-1)
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x" * 5000})
    assert r.status_code == 400 and "exceeds this server's limit (4096 bytes)" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid request")


def test_a_full_queue_answers_429(live):
    client, worker = live["client"], live["server"].worker
    worker.pause()
    try:
        with concurrent.futures.ThreadPoolExecutor(MAX_SEQS + MAX_QUEUE) as pool:
            futures = [pool.submit(client.completions.create, model=m, prompt=PROMPT, max_tokens=3, temperature=0)
                       for m in (NAME, "dec", "enc")[: MAX_SEQS + MAX_QUEUE]]
            deadline = time.monotonic() + 20
            while worker.in_flight < MAX_SEQS + MAX_QUEUE:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(openai.RateLimitError, match="queue is full"):
                client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3)
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


def test_adapters_load_and_unload_over_http(live):
    client, url, tok = live["client"], live["url"], live["server"].tokenizer
    load = url + "/v1/load_lora_adapter"
    r = httpx.post(load, json={"lora_name": "mlp", "lora_path": "mlp"})
    assert r.status_code == 200 and r.json()["loaded"] == "mlp"
    want, _ = engine_text(live, tok.encode(PROMPT), "mlp", 8)
    assert client.completions.create(model="mlp", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text == want
    assert httpx.post(load, json={"lora_name": "mlp", "lora_path": "mlp"}).status_code == 409
    for escape in ("../dec", str(live["root"] / "dec"), "../../../etc"):
        r = httpx.post(load, json={"lora_name": "x", "lora_path": escape})
        assert r.status_code == 400 and "outside the adapter directory" in r.json()["error"]["message"]
    r = httpx.post(load, json={"lora_name": "x", "lora_path": "missing"})
    assert r.status_code == 400 and "is not a directory" in r.json()["error"]["message"]
    unload = url + "/v1/unload_lora_adapter"
    assert httpx.post(unload, json={"lora_name": "mlp"}).json() == {"unloaded": "mlp", "draining": None}
    r = httpx.post(unload, json={"lora_name": "mlp"})
    assert r.status_code == 404 and "loaded adapters: dec, enc" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp", prompt=PROMPT, max_tokens=2)
    assert [m.id for m in client.models.list().data] == [NAME, "dec", "enc"]


def test_kvgraft_serve_checks_its_arguments_before_loading(capsys):
    from kvgraft.cli import main

    assert main(["serve", NAME, "--adapter", "no-equals-sign"]) == 2
    assert "--adapter 'no-equals-sign' must be NAME=PATH" in capsys.readouterr().err
    assert main(["serve", NAME, "--adapter", "a=x", "--adapter", "a=y"]) == 2
    assert "names 'a' twice" in capsys.readouterr().err
    assert main(["serve", NAME, "--port", "70000"]) == 2
    assert "--port (70000)" in capsys.readouterr().err


def test_kvgraft_serve_passes_its_options_to_build_server(monkeypatch, capsys):
    import kvgraft.serve.server as server_module
    from kvgraft.cli import main

    seen = []

    class Fake:
        config = type("C", (), {"model_name": NAME})()

    def fake_build(model, adapters, **kwargs):
        seen.append((model, adapters, kwargs))
        return Fake()

    monkeypatch.setattr(server_module, "build_server", fake_build)
    monkeypatch.setattr(server_module, "serve", lambda *a, **k: None)
    assert main(["serve", NAME, "--adapter", "a=x", "--max-seqs", "3"]) == 0
    assert main(["serve", NAME, "--no-prefix-cache"]) == 0
    (m1, a1, k1), (_, a2, k2) = seen
    assert (m1, a1, k1["max_seqs"], k1["prefix_cache"]) == (NAME, {"a": "x"}, 3, True)
    assert (a2, k2["prefix_cache"]) == ({}, False)
    assert "serving kvgraft-ced-8m" in capsys.readouterr().out


def test_build_server_passes_prefix_cache_to_the_engine():
    on = build_server(BASE, max_seqs=1, max_seq_len=64)
    off = build_server(BASE, max_seqs=1, max_seq_len=64, prefix_cache=False)
    assert on.engine.prefix is not None and off.engine.prefix is None
