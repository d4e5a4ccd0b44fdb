"""PEFT end to end through transformers' classes: ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
base), adapter)`` then ``.generate`` gives, with greedy decoding, the tokens kvgraft's serving engine gives with
that adapter loaded by name (``Engine.load_adapter``, prefix cache on as ``kvgraft serve`` runs it): with one
adapter, with several (``set_adapter`` switches, ``disable_adapter`` is the base, ``adapter_names`` routes each
row of a batch), and after ``merge_and_unload()``. On a causal encoder-decoder in kvgraft's own format
(``KvgraftForCausalLM``) and on a stock ``LlamaForCausalLM``; tiny random models, and the shipped references."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from factories import sharp_model
from peft import PeftModel
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from kvgraft.adapters.lora import AdapterConfig, add_adapter, randomize_adapter, save_adapter
from kvgraft.adapters.placement import Placement
from kvgraft.hf import KvgraftForCausalLM, load_pretrained, save_pretrained
from kvgraft.model.presets import get_preset
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
CED = get_preset("ced-tiny").replace(num_layers=6, kv_source_layers=(1, 3), qkv_bias=True)
LLAMA = get_preset("llama-tiny").replace(num_layers=3)
KINDS = {"ced": (CED, "kvgraft", KvgraftForCausalLM), "llama": (LLAMA, "llama", LlamaForCausalLM)}
# everywhere (r4); the decoder half's attention (r8, alpha 4: on the CED its kv_b/o, read by absorbed decode);
# the MLPs from layer 1 on (r2)
ADAPTERS = {
    "all": (Placement("all", ("all-linear",)), AdapterConfig(rank=4)),
    "dec": (Placement("decoder-half", ("attention",)), AdapterConfig(rank=8, alpha=4.0)),
    "mlp": (Placement("from:1", ("mlp",)), AdapterConfig(rank=2)),
}
LENGTHS = (1, 7, 20)  # 20: past ced-tiny's window of 8, so the compressed shared stream is read
NEW = 10


build = sharp_model  # tests/factories.py


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


_setups: dict = {}


def setup(kind, tmp_path_factory):
    """(base directory, {adapter: directory}, {adapter or None: the engine's greedy tokens per prompt})."""
    if kind not in _setups:
        cfg, model_type, _ = KINDS[kind]
        base = build(cfg)
        root = tmp_path_factory.mktemp(f"peft-{kind}")
        base_dir = save_pretrained(base, root / "base", model_type=model_type)
        dirs = {}
        for i, (name, (placement, acfg)) in enumerate(ADAPTERS.items()):
            pm = add_adapter(copy.deepcopy(base), placement, acfg)
            randomize_adapter(pm, 0.15, seed=10 + i)
            dirs[name] = save_adapter(pm, root / name)
        _setups[kind] = (base_dir, dirs, served(base_dir, dirs, prompts(cfg.vocab_size), NEW))
    return _setups[kind]


def served(base_dir, dirs, ps, new) -> dict:
    """What kvgraft's serving engine (kvgraft serve's in-process API) decodes for each adapter and the base."""
    engine = Engine(load_pretrained(base_dir), EngineOptions(max_seqs=8, prefix_cache=True))
    for name, d in dirs.items():
        engine.load_adapter(name, d)
    want = {a: engine.generate(ps, SamplingParams(max_new_tokens=new), adapters=a) for a in [None, *dirs]}
    assert len({tuple(map(tuple, w)) for w in want.values()}) == len(want)  # every adapter changes the tokens
    return want


def peft(base_dir, dirs, names):
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    pm = PeftModel.from_pretrained(model, str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        pm.load_adapter(str(dirs[name]), adapter_name=name)
    return pm.eval()


def greedy(model, prompt: list[int], new: int = NEW, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new, do_sample=False, **kw)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_peft_generate_with_one_adapter_gives_the_served_tokens(kind, tmp_path_factory):
    """Was: on KvgraftForCausalLM generate -> to_kvgraft() -> strict load_state_dict failed on PEFT's wrapped
    names (``...q_proj.base_layer.weight``, ``...lora_A.default.weight``)."""
    base_dir, dirs, want = setup(kind, tmp_path_factory)
    ps = prompts(KINDS[kind][0].vocab_size)
    for name in ("dec", "all"):
        pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(dirs[name])).eval()
        assert type(pm.get_base_model()) is KINDS[kind][2]
        assert [greedy(pm, p) for p in ps] == want[name]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_set_adapter_switches_and_disable_adapter_is_the_base(kind, tmp_path_factory):
    base_dir, dirs, want = setup(kind, tmp_path_factory)
    ps = prompts(KINDS[kind][0].vocab_size)
    pm = peft(base_dir, dirs, ["all", "dec", "mlp"])
    for name in ("mlp", "all", "dec", "all"):
        pm.set_adapter(name)
        assert [greedy(pm, p) for p in ps] == want[name], name
    with pm.disable_adapter():
        assert [greedy(pm, p) for p in ps] == want[None]
    assert [greedy(pm, p) for p in ps] == want["all"]  # enabled again


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_adapter_names_route_each_row_of_a_batch(kind, tmp_path_factory):
    """``PeftModel.generate(adapter_names=[...])``: each row decodes with its adapter (``__base__``: none)."""
    base_dir, dirs, want = setup(kind, tmp_path_factory)
    p = prompts(KINDS[kind][0].vocab_size)[2]  # one prompt for every row: no padding
    pm = peft(base_dir, dirs, ["all", "dec", "mlp"])
    pm.set_adapter("all")
    names = ["dec", "__base__", "mlp", "all"]
    with torch.no_grad():
        out = pm.generate(input_ids=torch.tensor([p] * 4), max_new_tokens=NEW, do_sample=False, adapter_names=names)
    assert out[:, len(p) :].tolist() == [want[None if n == "__base__" else n][2] for n in names]
    assert [greedy(pm, q) for q in prompts(KINDS[kind][0].vocab_size)] == want["all"]  # hooks gone, "all" active


def test_adapter_names_with_padded_rows_on_the_encoder_decoder(tmp_path_factory):
    """Left-padded rows of different lengths and adapters (kvgraft's generate drops the padding)."""
    base_dir, dirs, want = setup("ced", tmp_path_factory)
    ps = prompts(CED.vocab_size)
    T = max(map(len, ps))
    ids = torch.zeros(len(ps), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(ps):
        ids[r, T - len(p) :], mask[r, T - len(p) :] = torch.tensor(p), 1
    names = ["mlp", "all", "dec"]
    pm = peft(base_dir, dirs, ["all", "dec", "mlp"])
    with torch.no_grad():
        out = pm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, adapter_names=names)
    assert out[:, T:].tolist() == [want[n][r] for r, n in enumerate(names)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_merge_and_unload_gives_the_adapter_tokens(kind, tmp_path_factory, tmp_path):
    base_dir, dirs, want = setup(kind, tmp_path_factory)
    ps = prompts(KINDS[kind][0].vocab_size)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(dirs["all"])).eval()
    merged = merged.merge_and_unload()
    assert type(merged) is KINDS[kind][2]
    assert not any("lora" in n or "base_layer" in n for n in merged.state_dict())
    assert [greedy(merged, p) for p in ps] == want["all"]
    # and saved, it serves those tokens as a plain base model
    merged.save_pretrained(tmp_path / "merged")
    assert (
        Engine(load_pretrained(tmp_path / "merged"), EngineOptions(max_seqs=4)).generate(ps, SamplingParams(max_new_tokens=NEW))
        == want["all"]
    )


def test_generate_leaves_a_training_model_in_training_mode(tmp_path_factory):
    """generate runs the wrapper's own modules in eval mode, then puts every module's mode back."""
    base_dir, dirs, want = setup("ced", tmp_path_factory)
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(dirs["all"]), is_trainable=True)
    pm.train()
    assert greedy(pm, prompts(CED.vocab_size)[1]) == want["all"][1]
    assert all(m.training for m in pm.modules())


@pytest.mark.parametrize("name", ["kvgraft-ced-8m", "kvgraft-ced-8m-deep", "kvgraft-llama-8m"])
def test_the_shipped_references_with_an_adapter(name, tmp_path):
    """The shipped models (the CED in kvgraft's format, the Llama a stock LlamaForCausalLM) with a kvgraft adapter
    made on them: PEFT's generate equals the engine's tokens."""
    base_dir = ROOT / "models" / name
    if not (base_dir / "model.safetensors").is_file():
        pytest.skip(f"{base_dir} is not present")
    pm = add_adapter(load_pretrained(base_dir), Placement("decoder-half", ("attention",)), AdapterConfig(rank=4))
    randomize_adapter(pm, 0.05, seed=3)
    dirs = {"dec": save_adapter(pm, tmp_path / "dec")}
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(1, 8192, (n,), generator=g).tolist() for n in (9, 90)]  # 90: past ced-8m's window of 64
    want = served(base_dir, dirs, ps, 12)
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(dirs["dec"])).eval()
    assert [greedy(hf, p, 12, eos_token_id=None) for p in ps] == [w[:12] for w in want["dec"]]
