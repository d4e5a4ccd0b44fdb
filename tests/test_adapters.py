"""Placement-aware LoRA: fresh adapters change nothing, merge is exact and idempotent, absorbed decode reads
the adapter, placements compile by meaning, the sharing certificate holds against the model itself,
backward stops at the first trainable layer, PEFT's files load through transformers' Auto classes."""

from __future__ import annotations

import copy

import pytest
import torch
from factories import sharp_model

from kvgraft.adapters.certificate import certify
from kvgraft.adapters.lora import (
    AdapterConfig,
    add_adapter,
    dry_run,
    load_adapter,
    randomize_adapter,
    save_adapter,
    trainable_parameters,
    transformer_of,
)
from kvgraft.adapters.optim import adapter_param_groups, freeze
from kvgraft.adapters.placement import PRESETS, Placement, compile_placement
from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.presets import get_preset

# a causal encoder-decoder with the reference's layout: 8 layers, kv_source 1, 3 and pivot 4
CED = get_preset("ced-tiny").replace(num_layers=8, kv_source_layers=(1, 3, 4), qkv_bias=True)
LLAMA = get_preset("llama-tiny").replace(num_layers=4)
MLA = LLAMA.replace(
    attention_kinds=("mla",) * 4, kv_lora_rank=6, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, mla_latent_norm=True
)


build = sharp_model  # tests/factories.py


def ids(cfg, n=2, t=24, seed=1):
    return torch.randint(0, cfg.vocab_size, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [CED, LLAMA, MLA], ids=["ced", "llama", "mla"])
def test_fresh_adapter_changes_nothing_and_merge_is_exact_and_idempotent(cfg):
    model = build(cfg)
    x = ids(cfg)
    with torch.no_grad():
        base = model(x)
        pm = add_adapter(model, Placement("all", ("all-linear",)), AdapterConfig(rank=4))
        assert torch.equal(pm(x), base)  # B = 0
        randomize_adapter(pm, 0.1)
        adapted = pm(x)
        assert (adapted - base).abs().max() > 1e-2
        weights = {n: p.clone() for n, p in pm.named_parameters() if "base_layer" in n}
        pm.merge_adapter()
        merged = pm(x)
        pm.merge_adapter()  # a second merge is a no-op
        torch.testing.assert_close(pm(x), merged, atol=0, rtol=0)
        torch.testing.assert_close(merged, adapted, atol=2e-4, rtol=0)
        pm.unmerge_adapter()
        pm.unmerge_adapter()
        for n, p in pm.named_parameters():
            if n in weights:
                torch.testing.assert_close(p, weights[n], atol=1e-6, rtol=0)
        torch.testing.assert_close(pm(x), adapted, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cfg", [CED, MLA], ids=["ced", "mla"])
def test_absorbed_decode_with_a_peft_adapter_on_q_kv_b_o_equals_the_expanded_path(cfg):
    model = build(cfg)
    pm = add_adapter(model, Placement("all", (), include=("*.q_proj", "*.kv_b_proj", "*.o_proj")), AdapterConfig(rank=4))
    randomize_adapter(pm, 0.2)
    x = ids(cfg)
    with torch.no_grad():
        full = pm(x)  # cache-free: the expanded path through PEFT's layers
        cache = model.new_cache(2, 32)
        steps = [pm(x[:, :9], cache=cache)] + [pm(x[:, t : t + 1], cache=cache) for t in range(9, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=5e-5, rtol=0)
    if cfg is MLA:
        assert model.layers[0].self_attn.fold_q  # the folded decode path read the adapted weights


def test_placements_compile_by_meaning():
    names = compile_placement(CED, Placement("decoder-half", ("kv-writers",)))
    assert names == [
        "layers.4.self_attn.k_proj",
        "layers.4.self_attn.v_proj",
        "layers.4.self_attn.compressor.kv_a_proj",
        "layers.4.self_attn.compressor.gate_proj",
    ] + [f"layers.{i}.self_attn.{m}" for i in (5, 6, 7) for m in ("k_proj", "v_proj")]
    frozen = compile_placement(CED, Placement("decoder-half", ("all-linear",), freeze_kv_writers=True))
    assert not any(n.startswith("layers.4.") and (".compressor." in n or n.endswith(("k_proj", "v_proj"))) for n in frozen)
    assert "layers.4.self_attn.q_proj" in frozen and "layers.5.self_attn.k_proj" in frozen
    assert compile_placement(CED, Placement("encoder-half", ("attention-out",))) == [
        f"layers.{i}.self_attn.o_proj" for i in range(4)
    ]
    assert compile_placement(CED, Placement((2, 6), ("query", "mlp-down"))) == [
        "layers.2.self_attn.q_proj",
        "layers.2.mlp.down_proj",
        "layers.6.self_attn.q_proj",
        "layers.6.mlp.down_proj",
    ]
    assert compile_placement(CED, Placement("from:7", ("mlp-gate-up",))) == ["layers.7.mlp.gate_proj", "layers.7.mlp.up_proj"]
    slim = compile_placement(CED, PRESETS["slim-attention-r16"].placement)
    assert not any(n.endswith("q_proj") or ".compressor." in n for n in slim)
    assert not any("index" in n for n in compile_placement(CED.replace(index_topk=2), Placement()))
    assert compile_placement(CED, Placement("all", (), include=("layers.0.mlp.*",))) == [
        "layers.0.mlp.gate_proj",
        "layers.0.mlp.up_proj",
        "layers.0.mlp.down_proj",
    ]
    with pytest.raises(ValueError, match="matches no module; the model's projections are: layers.0.self_attn.q_proj"):
        compile_placement(CED, Placement("all", ("query",), exclude=("*q_proj",)))
    with pytest.raises(ValueError, match="include glob 'layers.9.*' matches no module"):
        compile_placement(CED, Placement("all", (), include=("layers.9.*",)))
    with pytest.raises(ValueError, match=r"layers \[9\] do not exist"):
        compile_placement(CED, Placement((9,), ("query",)))
    for bad, msg in [
        (dict(layers="middle"), "layers 'middle'"),
        (dict(modules=("heads",)), "module groups"),
        (dict(layers=()), "non-empty"),
    ]:
        with pytest.raises(ValueError, match=msg):
            Placement(**bad)
    report = dry_run(CED, Placement("decoder-half", ("all-linear",), freeze_kv_writers=True), AdapterConfig(rank=4))
    assert report["trainable_parameters"] == sum(r["lora_params"] for r in report["modules"])
    pm = add_adapter(build(CED), Placement("decoder-half", ("all-linear",), freeze_kv_writers=True), AdapterConfig(rank=4))
    assert trainable_parameters(pm) == report["trainable_parameters"]


def _prefill_cache(model_or_peft, base_cfg, x):
    cache = PagedKVCache(base_cfg, num_blocks=8, block_size=16, max_seqs=2, max_seq_len=64)
    seqs = [cache.add_sequence() for _ in range(x.shape[0])]
    with torch.no_grad():
        model_or_peft(x.reshape(-1), ctx=BatchContext(cache, seqs, [x.shape[1]] * x.shape[0]))
    return cache


def _group_tensor(cache, group):
    kind, layer = group.split(":")
    layer = int(layer)
    return {"segment": cache.segments, "window": cache.rings, "kv": cache.paged}[kind][layer]


@pytest.mark.parametrize(
    "cfg,placement",
    [
        (CED, Placement("decoder-half", ("all-linear",), freeze_kv_writers=True)),
        (CED, Placement("decoder-half", ("all-linear",))),
        (CED, Placement("encoder-half", ("all-linear",))),
        (CED, Placement((3,), ("query", "mlp"))),
        (LLAMA, Placement("decoder-half", ("all-linear",), freeze_kv_writers=True)),
        (MLA, Placement((1, 2), ("attention",))),
    ],
    ids=["ced-decoder-frozen", "ced-decoder", "ced-encoder", "ced-layer3-q-mlp", "llama-decoder", "mla-middle"],
)
def test_certificate_holds_against_the_model(cfg, placement):
    base = build(cfg)
    x = ids(cfg, t=40)
    cert = certify(cfg, compile_placement(cfg, placement))
    reference = _prefill_cache(base, cfg, x)
    pm = add_adapter(build(cfg), placement, AdapterConfig(rank=4))
    randomize_adapter(pm, 0.2)
    adapted = _prefill_cache(pm, cfg, x)
    for group in cert.untouched:
        assert torch.equal(_group_tensor(adapted, group), _group_tensor(reference, group)), group
    for group in cert.touched:
        assert not torch.equal(_group_tensor(adapted, group), _group_tensor(reference, group)), group


def test_the_seed_rule_decoder_half_with_frozen_writers_shares_the_cache():
    frozen = certify(CED, compile_placement(CED, Placement("decoder-half", ("all-linear",), freeze_kv_writers=True)))
    assert frozen.shares_cache and frozen.touched == ("window:5", "window:6", "window:7")
    assert not certify(CED, compile_placement(CED, Placement("decoder-half", ("all-linear",)))).shares_cache
    assert not certify(CED, compile_placement(CED, Placement("encoder-half", ("all-linear",)))).shares_cache


@pytest.mark.parametrize("checkpointing", [False, True])
def test_backward_stops_at_the_first_trainable_layer(checkpointing):
    model = build(CED)
    pm = add_adapter(model, Placement("decoder-half", ("all-linear",), freeze_kv_writers=True), AdapterConfig(rank=4))
    randomize_adapter(pm, 0.05)
    model.train()
    model.gradient_checkpointing = checkpointing
    grad_on = {}

    def record(i):
        def hook(module, args):
            grad_on.setdefault(i, torch.is_grad_enabled())

        return hook

    hooks = [layer.register_forward_pre_hook(record(i)) for i, layer in enumerate(model.layers)]
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    x = ids(CED, t=32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = pm(x).logsumexp(-1).mean()
    loss.backward()
    for h in hooks:
        h.remove()
    assert model.first_trainable_layer() == 4
    assert [grad_on[i] for i in range(8)] == [False] * 4 + [True] * 4
    decoder_bytes = sum(saved)
    # the same adapter everywhere keeps activations for every layer
    model2 = build(CED)
    pm2 = add_adapter(model2, Placement("all", ("all-linear",)), AdapterConfig(rank=4))
    model2.train()
    model2.gradient_checkpointing = checkpointing
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm2(x).logsumexp(-1).mean().backward()
    # without checkpointing most of what is kept is per-layer activations; with it, the layers' inputs
    # and the head's logits (the same for both), so the saving is smaller but still there
    assert decoder_bytes < (0.9 if checkpointing else 0.65) * sum(saved)
    assert all(p.grad is not None for n, p in pm.named_parameters() if p.requires_grad)


def test_lr_multipliers_loraplus_and_frozen_trees():
    pm = add_adapter(build(CED), Placement("all", ("all-linear",)), AdapterConfig(rank=2))
    frozen = freeze(pm, ("layers.4.self_attn.compressor.*",))
    assert frozen and all(".compressor." in n for n in frozen)
    groups = adapter_param_groups(pm, 0.0, {"*.o_proj": 0.5, "layers.7.*": 0.1}, loraplus_ratio=4.0)
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    for n, p in pm.named_parameters():
        if not p.requires_grad:
            assert id(p) not in scale
            continue
        want = (0.5 if ".o_proj." in n else 1.0) * (0.1 if ".layers.7." in n else 1.0) * (4.0 if ".lora_B." in n else 1.0)
        assert scale[id(p)] == pytest.approx(want), n
    with pytest.raises(ValueError, match="match no trainable module"):
        adapter_param_groups(pm, 0.0, {"*.nothing": 2.0})
    with pytest.raises(ValueError, match="freeze glob"):
        freeze(pm, ("*.nothing",))


def test_save_load_and_transformers_auto_classes_with_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kvgraft.hf import save_pretrained

    base = build(CED)
    save_pretrained(base, tmp_path / "base", model_type="kvgraft")
    pm = add_adapter(build(CED), Placement("decoder-half", ("all-linear",), freeze_kv_writers=True), AdapterConfig(rank=4))
    randomize_adapter(pm, 0.1)
    out = save_adapter(pm, tmp_path / "adapter")
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "kvgraft_adapter.json"}
    x = ids(CED)
    with torch.no_grad():
        want = pm(x)
        again = load_adapter(build(CED), out)
        torch.testing.assert_close(again(x), want, atol=0, rtol=0)
        hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), str(out)).eval()
        torch.testing.assert_close(hf(input_ids=x).logits, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="trained on another base"):
        load_adapter(build(CED.replace(qkv_bias=False)), out)
    assert transformer_of(again).first_trainable_layer() == 8  # loaded for inference: frozen


@pytest.mark.parametrize("latent_norm", [True, False], ids=["own-latent-norm", "pad-latent"])
def test_adapter_carries_to_the_stock_deepseek_v3_export(tmp_path, latent_norm):
    """A stock DeepSeek-V3 export of an MLA model takes the adapter with peft.PeftModel.from_pretrained on
    transformers' DeepseekV3ForCausalLM, with kvgraft's logits: for a base with its own latent norm, and for
    one without (what kvgraft convert makes; the export pins stock's latent norm with a constant coordinate)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kvgraft.hf import export_deepseek_v3
    from kvgraft.hf.deepseek import ExportOptions
    from kvgraft.hf.deepseek.adapters import export_adapter_deepseek_v3

    cfg = MLA.replace(qk_nope_head_dim=8, rms_norm_eps=1e-6, mla_latent_norm=latent_norm)
    base = build(cfg)
    # the exact latent for a base without its own norm is the transformers-only "pad" construction
    export_deepseek_v3(
        base, tmp_path / "stock", ExportOptions(measure=False, target="engines" if latent_norm else "transformers")
    )
    with pytest.raises(ValueError, match="MLP modules"):  # PEFT would drop them on deepseek_v3 (see export.py)
        mlp = add_adapter(build(cfg), Placement("all", ("all-linear",)), AdapterConfig(rank=4))
        save_adapter(mlp, tmp_path / "mlp")
        export_adapter_deepseek_v3(tmp_path / "mlp", base, tmp_path / "mlp-ds")
    pm = add_adapter(build(cfg), Placement("all", ("attention",)), AdapterConfig(rank=4))  # q, kv_a, kv_b, o
    randomize_adapter(pm, 0.1)
    save_adapter(pm, tmp_path / "adapter")
    export_adapter_deepseek_v3(tmp_path / "adapter", base, tmp_path / "adapter-ds")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "stock", dtype=torch.float32)
    hf = PeftModel.from_pretrained(stock, str(tmp_path / "adapter-ds")).eval()
    x = ids(cfg)
    with torch.no_grad():
        want = pm(x)
        got = hf(input_ids=x).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    with torch.no_grad(), hf.disable_adapter():  # the adapter really matters there
        assert (hf(input_ids=x).logits - got).abs().max() > 1e-2
    if not latent_norm:  # only the exact "pad" export can carry it
        with pytest.raises(ValueError, match="latent_norm 'fit'"):
            export_adapter_deepseek_v3(tmp_path / "adapter", base, tmp_path / "adapter-fit", latent_norm="fit")


def test_adapter_export_refuses_q_proj_on_a_base_with_query_bias(tmp_path):
    """Stock DeepSeek-V3 takes biased queries (Qwen2) through q_a_proj -> q_a_layernorm -> q_b_proj, which a
    q_proj delta cannot follow: refused before anything is written, naming what to train instead."""
    from kvgraft.hf.deepseek.adapters import export_adapter_deepseek_v3

    cfg = MLA.replace(qk_nope_head_dim=8, qkv_bias=True)
    base = build(cfg)
    with torch.no_grad():
        for b in base.layers:
            b.self_attn.q_proj.bias.normal_()
    pm = add_adapter(copy.deepcopy(base), Placement("all", ("attention",)), AdapterConfig(rank=4))  # on that base
    save_adapter(pm, tmp_path / "adapter")
    with pytest.raises(ValueError, match="adapts q_proj of a base whose queries have a bias"):
        export_adapter_deepseek_v3(tmp_path / "adapter", base, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _old_format(adapter, base_path) -> None:
    """Rewrite an adapter's metadata as kvgraft wrote it before issue 23: the base as an absolute path, no
    weights fingerprint."""
    import json

    meta_file = adapter / "kvgraft_adapter.json"
    meta = json.loads(meta_file.read_text())
    meta.update(format_version=1, base=str(base_path.resolve()))
    meta_file.write_text(json.dumps(meta))


def test_a_moved_or_copied_adapter_loads_and_refuses_another_base_naming_both_fingerprints(tmp_path):
    """Portable adapters (issue 23): the base is recorded by a path relative to the adapter (or a shipped
    model's name), never as an absolute path, with a fingerprint of its weights."""
    import json
    import shutil

    from kvgraft.adapters.fingerprint import resolve_base
    from kvgraft.adapters.lora import read_meta
    from kvgraft.hf import load_pretrained, save_pretrained

    save_pretrained(build(CED), tmp_path / "site" / "base", model_type="kvgraft")
    dec = Placement("decoder-half", ("all-linear",), freeze_kv_writers=True)
    pm = add_adapter(build(CED), dec, AdapterConfig(rank=4))
    randomize_adapter(pm, 0.1)
    out = save_adapter(pm, tmp_path / "site" / "runs" / "dec", base=tmp_path / "site" / "base")
    text = (out / "kvgraft_adapter.json").read_text()
    assert str(tmp_path) not in text and str(tmp_path) not in (out / "adapter_config.json").read_text()
    meta = read_meta(out)
    assert meta["base"]["name"] == "base" and meta["base"]["path"] == "../../base" and meta["format_version"] == 2
    x = ids(CED)
    with torch.no_grad():
        want = pm(x)
    shutil.move(tmp_path / "site", tmp_path / "elsewhere")  # the adapter and its base, moved together
    moved = tmp_path / "elsewhere" / "runs" / "dec"
    assert resolve_base(moved, read_meta(moved)) == moved / "../../base"
    from kvgraft.adapters.fingerprint import relocate_reference  # what an exported copy records (export.py)

    exported = relocate_reference(read_meta(moved), moved, tmp_path / "exports" / "dec")
    assert exported["base"]["path"] == "../../elsewhere/base"
    copied = shutil.copytree(moved, tmp_path / "other-machine" / "dec")  # the adapter alone, copied
    with pytest.raises(FileNotFoundError, match=f"base 'base' \\(fingerprint {meta['base']['fingerprint']}\\)"):
        resolve_base(copied, read_meta(copied))
    base = load_pretrained(tmp_path / "elsewhere" / "base").float()
    with torch.no_grad():
        torch.testing.assert_close(load_adapter(base, copied)(x), want, atol=0, rtol=0)
    # the same base in another precision is the same base
    load_adapter(load_pretrained(tmp_path / "elsewhere" / "base", dtype=torch.bfloat16), copied)
    load_adapter(load_pretrained(tmp_path / "elsewhere" / "base", dtype=torch.float16), copied)
    # same architecture, other weights: refused, naming both fingerprints
    nudged = build(CED)
    with torch.no_grad():
        nudged.layers[5].mlp.down_proj.weight.mul_(1.05)  # one tensor, 5%
    for other in (build(CED, seed=1), nudged):
        with pytest.raises(
            ValueError,
            match=f"trained on another base model: its base 'base' has fingerprint "
            f"{meta['base']['fingerprint']}, this model has [0-9a-f]{{16}}",
        ):
            load_adapter(other, copied)
    # an adapter written before fingerprints (absolute base path, no weights fingerprint) still loads, warned
    _old_format(copied, tmp_path / "elsewhere" / "base")
    assert "fingerprint" not in json.dumps(read_meta(copied)["base"])
    with pytest.warns(UserWarning, match="older kvgraft"):
        old = load_adapter(build(CED), copied)
    with torch.no_grad():
        torch.testing.assert_close(old(x), want, atol=0, rtol=0)
    with pytest.warns(UserWarning, match="records its base as the path"):
        assert resolve_base(copied, read_meta(copied)) == (tmp_path / "elsewhere" / "base").resolve()


def test_an_adapter_on_a_shipped_model_names_it_and_the_fingerprint_is_cheap(tmp_path):
    from kvgraft.adapters import fingerprint
    from kvgraft.adapters.fingerprint import resolve_base, weights_sample
    from kvgraft.adapters.lora import read_meta
    from kvgraft.hf import load_pretrained
    from kvgraft.reference import resolve_model

    path = resolve_model("kvgraft-ced-8m")
    base = load_pretrained(path)
    pm = add_adapter(base, Placement("decoder-half", ("attention",), freeze_kv_writers=True), AdapterConfig(rank=2))
    out = save_adapter(pm, tmp_path / "a", base=path)
    meta = read_meta(out)
    assert meta["base"]["name"] == "kvgraft-ced-8m" and meta["base"]["reference"] and "path" not in meta["base"]
    assert str(path.parent) not in (out / "kvgraft_adapter.json").read_text()
    assert resolve_base(out, meta) == resolve_model("kvgraft-ced-8m")
    # a strided sample, not the weights: at most SAMPLE_BUDGET values (a 7B model reads as many)
    _, sample = weights_sample(load_pretrained(path))
    assert 0 < sample.numel() <= fingerprint.SAMPLE_BUDGET
