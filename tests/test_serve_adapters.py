"""Adapters in the engine: a mixed-adapter batch (several adapters and base rows, different prompt lengths)
gives every request exactly the tokens it gets alone through PEFT's layers; hot-load and unload between
steps; the one door of absorbed latent decode returns each group's adapter's weight; bad adapters refused.
Tiny random models (causal encoder-decoder, MLA, Llama) with random non-zero adapter weights."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from factories import sharp_model
from torch import nn

from kvgraft.adapters.lora import AdapterConfig, add_adapter, load_adapter, randomize_adapter, save_adapter, transformer_of
from kvgraft.adapters.placement import Placement
from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.presets import get_preset
from kvgraft.runtime.adapters import AdapterBusyError, AdapterError, MultiLoraLinear, UnknownAdapterError, read_adapter
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

CED = get_preset("ced-tiny").replace(num_layers=6, kv_source_layers=(1, 3), qkv_bias=True)
LLAMA = get_preset("llama-tiny").replace(num_layers=3)
MLA = LLAMA.replace(
    attention_kinds=("mla",) * 3, kv_lora_rank=6, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, mla_latent_norm=True
)
CONFIGS = {"ced": CED, "mla": MLA, "llama": LLAMA}
# three adapters: everywhere (r4), the decoder half's attention incl. q/kv_b/o of latent layers (r8, alpha 4),
# the MLPs from layer 1 on (r2)
ADAPTERS = {
    "all": (Placement("all", ("all-linear",)), AdapterConfig(rank=4)),
    "dec": (Placement("decoder-half", ("attention",)), AdapterConfig(rank=8, alpha=4.0)),
    "mlp": (Placement("from:1", ("mlp",)), AdapterConfig(rank=2)),
}
LENGTHS = [1, 7, 16, 33, 9, 50, 20, 3]
MAX_NEW = [6, 9, 4, 8, 7, 5, 9, 6]
ROUTE = ["all", "dec", None, "mlp", "all", "dec", "mlp", None]


build = sharp_model  # tests/factories.py


_setups: dict = {}


def setup(kind, tmp_path_factory):
    """(base model, {name: adapter dir}, {name: PEFT reference Transformer})."""
    if kind not in _setups:
        cfg = CONFIGS[kind]
        base = build(cfg)
        root = tmp_path_factory.mktemp(f"adapters-{kind}")
        dirs, refs = {}, {}
        for i, (name, (placement, acfg)) in enumerate(ADAPTERS.items()):
            pm = add_adapter(copy.deepcopy(base), placement, acfg)
            randomize_adapter(pm, 0.15, seed=10 + i)
            dirs[name] = save_adapter(pm, root / name)
            refs[name] = transformer_of(load_adapter(copy.deepcopy(base), dirs[name])).eval()
        _setups[kind] = (base, dirs, refs)
    return _setups[kind]


def prompts(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def alone(model, prompt, max_new) -> list[int]:
    return Engine(model, EngineOptions(max_seqs=1, max_batch_tokens=64)).generate(
        [prompt], SamplingParams(max_new_tokens=max_new)
    )[0]


def expected(kind, tmp_path_factory) -> list[list[int]]:
    base, _, refs = setup(kind, tmp_path_factory)
    ps = prompts(base.config.vocab_size)
    return [alone(base if a is None else refs[a], p, n) for p, n, a in zip(ps, MAX_NEW, ROUTE)]


@pytest.mark.parametrize("kind", ["ced", "mla", "llama"])
def test_a_mixed_adapter_batch_gives_each_request_its_tokens_alone(kind, tmp_path_factory):
    base, dirs, _ = setup(kind, tmp_path_factory)
    want = expected(kind, tmp_path_factory)
    assert len({tuple(w) for w in want}) == len(want)  # the adapters change the tokens
    engine = Engine(base, EngineOptions(max_seqs=8, max_batch_tokens=48))  # prompts arrive in chunks next to decodes
    for name, d in dirs.items():
        engine.load_adapter(name, d)
    got = engine.generate(prompts(base.config.vocab_size), [SamplingParams(max_new_tokens=n) for n in MAX_NEW], adapters=ROUTE)
    assert got == want
    if kind == "mla":
        assert base.layers[0].self_attn.fold_q  # absorbed decode took the folded path, per adapter


@pytest.mark.parametrize("kind", ["ced", "mla"])
def test_one_mixed_step_matches_each_row_through_peft(kind, tmp_path_factory):
    """Logits of one step (prefill rows and one-token decode rows of three adapters and the base) equal each
    row's own forward through PEFT's layers (absorbed decode reads each group's adapter weight)."""
    base, dirs, refs = setup(kind, tmp_path_factory)
    model = copy.deepcopy(base)
    engine = Engine(model, EngineOptions(max_seqs=4))
    for name, d in dirs.items():
        engine.load_adapter(name, d)
    names = ["all", "dec", None, "mlp"]
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, base.config.vocab_size, (n,), generator=g) for n in (12, 5, 9, 20)]
    with torch.no_grad():
        cache = PagedKVCache(base.config, num_blocks=16, block_size=16, max_seqs=4, max_seq_len=64)
        seqs = [cache.add_sequence() for _ in ids]
        model(torch.cat(ids), ctx=BatchContext(cache, seqs, [len(x) for x in ids], names))  # prefill, mixed
        nxt = torch.randint(0, base.config.vocab_size, (4,), generator=g)
        step = model(nxt, ctx=BatchContext(cache, seqs, [1] * 4, names))[0]  # decode, mixed
        for r, (x, name) in enumerate(zip(ids, names)):
            ref = base if name is None else refs[name]
            full = ref(torch.cat([x, nxt[r : r + 1]])[None])[0, -1]
            torch.testing.assert_close(step[r], full, atol=2e-4, rtol=0)


def test_hot_load_and_unload_between_steps(tmp_path_factory):
    base, dirs, refs = setup("ced", tmp_path_factory)
    model = copy.deepcopy(base)
    ps = prompts(base.config.vocab_size, seed=5)
    engine = Engine(model, EngineOptions(max_seqs=8, max_batch_tokens=32))
    engine.load_adapter("all", dirs["all"])
    r0 = engine.add_request(ps[3], SamplingParams(max_new_tokens=8), adapter="all")
    r1 = engine.add_request(ps[1], SamplingParams(max_new_tokens=8))
    for _ in range(2):
        engine.step()
    engine.load_adapter("dec", dirs["dec"])  # hot-load while r0 is running
    r2 = engine.add_request(ps[5], SamplingParams(max_new_tokens=6), adapter="dec")
    engine.step()
    with pytest.raises(AdapterBusyError, match=r"adapter 'all' has 1 unfinished requests \(\[0\]\)"):
        engine.unload_adapter("all")
    assert engine.unload_adapter("all", wait=True) is False  # deferred: unloads when r0 finishes
    with pytest.raises(AdapterError, match="'all' is being unloaded"):
        engine.add_request(ps[0], SamplingParams(max_new_tokens=2), adapter="all")
    engine.load_adapter("mlp", dirs["mlp"])
    r3 = engine.add_request(ps[0], SamplingParams(max_new_tokens=5), adapter="mlp")
    engine.run()
    assert engine.adapters.names() == ["dec", "mlp"]  # 'all' went once its request finished
    got = [engine.pop_finished(r).output for r in (r0, r1, r2, r3)]
    want = [alone(refs["all"], ps[3], 8), alone(base, ps[1], 8), alone(refs["dec"], ps[5], 6), alone(refs["mlp"], ps[0], 5)]
    assert got == want
    # reload under the same name after an unload; a waiting request is cancelled, then unload is free
    engine.load_adapter("all", dirs["all"])
    r4 = engine.add_request(ps[2], SamplingParams(max_new_tokens=3), adapter="all")
    engine.cancel(r4)
    for name in ("all", "dec", "mlp"):
        assert engine.unload_adapter(name) is True
    # every wrapper is gone: the model is the plain base again
    assert not any(isinstance(m, MultiLoraLinear) for m in model.modules())
    assert engine.generate([ps[1]], SamplingParams(max_new_tokens=8)) == [want[1]]


def test_preemption_with_adapters_gives_the_same_tokens(tmp_path_factory):
    base, dirs, _ = setup("ced", tmp_path_factory)
    want = expected("ced", tmp_path_factory)
    engine = Engine(copy.deepcopy(base), EngineOptions(max_seqs=8, num_blocks=6, block_size=16, max_batch_tokens=128))
    for name, d in dirs.items():
        engine.load_adapter(name, d)
    got = engine.generate(prompts(base.config.vocab_size), [SamplingParams(max_new_tokens=n) for n in MAX_NEW], adapters=ROUTE)
    assert engine.stats["preemptions"] > 0
    assert got == want


def test_bad_adapters_and_names_are_refused(tmp_path_factory, tmp_path):
    base, dirs, _ = setup("llama", tmp_path_factory)
    engine = Engine(copy.deepcopy(base), EngineOptions(max_seqs=2))
    with pytest.raises(UnknownAdapterError, match=r"unknown adapter 'x'; loaded adapters: none"):
        engine.add_request([1, 2], adapter="x")
    engine.load_adapter("all", dirs["all"])
    engine.load_adapter("dec", dirs["dec"])
    with pytest.raises(UnknownAdapterError, match=r"unknown adapter 'x'; loaded adapters: all, dec"):
        engine.add_request([1, 2], adapter="x")
    with pytest.raises(AdapterError, match="'all' is already loaded"):
        engine.load_adapter("all", dirs["all"])
    for bad in ("", "../x", "a b", "x" * 65):
        with pytest.raises(AdapterError, match="adapter name"):
            engine.load_adapter(bad, dirs["mlp"])
    other_base = build(LLAMA.replace(intermediate_size=96))
    with pytest.raises(AdapterError, match="trained on another base model"):
        Engine(other_base, EngineOptions(max_seqs=1)).load_adapter("all", dirs["all"])
    with pytest.raises(AdapterError, match="not an adapter directory"):
        engine.load_adapter("none", tmp_path)
    # DoRA (or anything plain LoRA does not compute) is refused by name
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in dirs["mlp"].iterdir():
        (dora / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(dict(cfg, use_dora=True)))
    with pytest.raises(AdapterError, match="use_dora=True"):
        engine.load_adapter("dora", dora)
    # a certificate that does not match the adapter's modules
    meta = json.loads((dora / "kvgraft_adapter.json").read_text())
    meta["certificate"]["touched"] = []
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    (dora / "kvgraft_adapter.json").write_text(json.dumps(meta))
    with pytest.raises(AdapterError, match="certificate in kvgraft_adapter.json does not match"):
        read_adapter(dora, base.config)
    assert engine.adapters.names() == ["all", "dec"]  # failed loads changed nothing


def test_the_door_refuses_a_weight_read_outside_a_group_of_a_mixed_step(tmp_path_factory):
    base, dirs, _ = setup("mla", tmp_path_factory)
    model = copy.deepcopy(base)
    engine = Engine(model, EngineOptions(max_seqs=2))
    engine.load_adapter("all", dirs["all"])
    q = model.layers[0].self_attn.q_proj
    assert isinstance(q, MultiLoraLinear) and isinstance(q.base_layer, nn.Linear)
    from kvgraft.model.batch import active_context
    from kvgraft.model.latent import linear_weight

    cache = PagedKVCache(base.config, num_blocks=4, block_size=16, max_seqs=2, max_seq_len=32)
    ctx = BatchContext(cache, [cache.add_sequence(), cache.add_sequence()], [1, 1], ["all", None])
    with active_context(ctx):
        with pytest.raises(RuntimeError, match=r"outside a group of a step whose rows use adapters \['all'\]"):
            linear_weight(q)
        seen = {}
        for gi, g in ctx.each_group():
            seen[g.adapter] = linear_weight(q)[0]
    assert seen[None] is q.base_layer.weight
    lw = q.loras["all"]
    torch.testing.assert_close(seen["all"], q.base_layer.weight + lw.B @ lw.A * lw.scale)
    assert linear_weight(q)[0] is q.base_layer.weight  # no step: the base


def test_a_mixed_group_reads_the_door_per_adapter(tmp_path_factory):
    """Causal encoder-decoder: rows of two adapters and the base share one group (MIXED); the door refuses
    one weight for the whole group and gives each adapter its own under each_adapter; the per-row gathered
    delta equals each row's own adapter's delta."""
    from kvgraft.model.batch import active_context
    from kvgraft.model.latent import linear_weight
    from kvgraft.model.plan import MIXED

    base, dirs, _ = setup("ced", tmp_path_factory)
    model = copy.deepcopy(base)
    engine = Engine(model, EngineOptions(max_seqs=3))
    engine.load_adapter("all", dirs["all"])
    engine.load_adapter("dec", dirs["dec"])
    layer = model.config.num_layers - 1
    kv_b = model.layers[layer].self_attn.kv_b_proj
    assert set(kv_b.loras) == {"all", "dec"}
    cache = PagedKVCache(base.config, num_blocks=6, block_size=16, max_seqs=3, max_seq_len=32)
    seqs = [cache.add_sequence() for _ in range(3)]
    ctx = BatchContext(cache, seqs, [1, 1, 1], ["all", None, "dec"])
    assert len(ctx.groups) == 1 and ctx.groups[0].adapter is MIXED
    x = torch.randn(3, 1, kv_b.in_features)
    with active_context(ctx):
        for gi, _ in ctx.each_group():
            with pytest.raises(RuntimeError, match="different adapters"):
                linear_weight(kv_b)
            y = kv_b(x)
            seen = {a: (rows, linear_weight(kv_b)[0]) for a, rows in ctx.each_adapter(gi)}
    want = torch.stack(
        [kv_b.base_layer(x[i]) + (kv_b.loras[a].delta(x[i]) if a else 0) for i, a in enumerate(["all", None, "dec"])]
    )
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert seen[None][0].tolist() == [1] and seen[None][1] is kv_b.base_layer.weight
    lw = kv_b.loras["dec"]
    torch.testing.assert_close(seen["dec"][1], kv_b.base_layer.weight + lw.B @ lw.A * lw.scale)
