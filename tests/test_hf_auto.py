"""kvgraft's own format through transformers' Auto classes: AutoConfig/AutoModelForCausalLM after ``import kvgraft.hf``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from kvgraft.hf import KvgraftConfig, KvgraftForCausalLM, load_config, load_pretrained, register_auto_classes, save_pretrained
from kvgraft.model.config import ModelConfig
from kvgraft.model.presets import get_preset
from kvgraft.model.transformer import Transformer
from kvgraft.runtime import generate

CED = get_preset("ced-tiny")
MLA = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    attention_kinds=("mla", "gqa"),
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    mla_latent_norm=True,
    qkv_bias=True,
)
CONFIGS = {
    "ced": CED,
    "ced-tied": CED.replace(tie_word_embeddings=True),
    "ced-m1": CED.replace(compress_rate=1),
    "ced-m1-tied": CED.replace(compress_rate=1, tie_word_embeddings=True),
    "mla": MLA,
    # Qwen3-style query norm (q_mix), both layers MLA sharing one latent slot, tied embeddings
    "mla-qknorm-shared-tied": MLA.replace(
        attention_kinds=("mla", "mla"), kv_slots=(0, 0), qk_norm=True, qkv_bias=False, tie_word_embeddings=True
    ),
}


def _model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A random model whose every tensor differs (norms and biases too), so any key mix-up shows."""
    model = Transformer(cfg)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _ids(cfg: ModelConfig, batch: int = 2, length: int = 21, seed: int = 2) -> torch.Tensor:
    # longer than ced-tiny's window (8) so the compressed shared KV is used
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _file_keys(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@torch.no_grad()
def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(params=sorted(CONFIGS))
def saved(request, tmp_path):
    cfg = CONFIGS[request.param]
    model = _model(cfg)
    directory = save_pretrained(model, tmp_path / "ckpt", model_type="kvgraft")
    return model, directory


def test_import_kvgraft_hf_registers_the_auto_classes(tmp_path):
    assert CONFIG_MAPPING["kvgraft"] is KvgraftConfig
    register_auto_classes()  # a second call is harmless
    assert CONFIG_MAPPING["kvgraft"] is KvgraftConfig
    save_pretrained(_model(CED), tmp_path / "ckpt", model_type="kvgraft")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def fresh(imports: str) -> subprocess.CompletedProcess:
        script = (
            f"import sys, {imports}\n"
            "from transformers import AutoModelForCausalLM\n"
            "print(type(AutoModelForCausalLM.from_pretrained(sys.argv[1])).__name__)\n"
        )
        return subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300, env=env
        )

    # a fresh interpreter: `import kvgraft.hf` alone is enough for the Auto classes
    result = fresh("kvgraft.hf")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "KvgraftForCausalLM"
    # that `import kvgraft` alone stays light (no transformers) is tests/test_light_import.py's


def test_auto_config_reads_the_kvgraft_model_config(saved):
    model, directory = saved
    config = AutoConfig.from_pretrained(directory)
    assert type(config) is KvgraftConfig and config.model_type == "kvgraft"
    assert config.model_config == model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        model.config.vocab_size,
        model.config.hidden_size,
        model.config.num_layers,
        model.config.num_heads,
    )
    assert config.tie_word_embeddings == model.config.tie_word_embeddings


@torch.no_grad()
def test_auto_model_loads_every_tensor_and_matches_kvgraft_logits(saved):
    model, directory = saved
    hf, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert type(hf) is KvgraftForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]
    tied = model.config.tie_word_embeddings
    # the wrapper's names are the file's (plus the tied head, which the file leaves out)
    assert set(hf.state_dict()) == _file_keys(directory) | ({"lm_head.weight"} if tied else set())
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    hf.eval()
    ids = _ids(model.config)
    assert _max_diff(hf(ids).logits, model(ids)) < 1e-5
    assert _max_diff(hf(ids, attention_mask=torch.ones_like(ids), return_dict=False)[0], model(ids)) < 1e-5


@torch.no_grad()
def test_wrapper_save_pretrained_round_trips_through_kvgraft(saved, tmp_path):
    model, directory = saved
    hf = AutoModelForCausalLM.from_pretrained(directory).eval()
    hf.save_pretrained(tmp_path / "resaved")
    assert load_config(tmp_path / "resaved") == model.config
    back = load_pretrained(tmp_path / "resaved")
    ids = _ids(model.config)
    assert _max_diff(back(ids), model(ids)) < 1e-5
    assert AutoConfig.from_pretrained(tmp_path / "resaved").model_config == model.config


@torch.no_grad()
def test_to_kvgraft_shares_the_parameters(saved):
    model, directory = saved
    hf = AutoModelForCausalLM.from_pretrained(directory).eval()
    inner = hf.to_kvgraft()
    assert type(inner) is Transformer and not inner.training
    assert inner.embed_tokens.weight is hf.model.embed_tokens.weight
    assert inner.lm_head.weight is hf.lm_head.weight
    ids = _ids(model.config)
    assert _max_diff(inner(ids), model(ids)) < 1e-5


@pytest.mark.parametrize("name", ["ced", "ced-m1-tied", "mla"])
def test_greedy_generate_equals_kvgraft_generate(name, tmp_path):
    cfg = CONFIGS[name]
    model = _model(cfg)
    save_pretrained(model, tmp_path / "ckpt", model_type="kvgraft")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    prompt = _ids(cfg, length=6)
    expected = generate(model, prompt, max_new_tokens=12)  # 18 tokens: past ced-tiny's window of 8
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=12, do_sample=False)
    assert out.shape == expected.shape
    assert torch.equal(out, expected)


def test_labels_give_the_shifted_cross_entropy():
    hf = KvgraftForCausalLM(KvgraftConfig.from_model_config(CED)).eval()
    ids = _ids(CED)
    labels = ids.clone()
    labels[:, :3] = -100
    out = hf(ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, CED.vocab_size), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    assert torch.allclose(out.loss, expected)


def test_built_from_config_is_initialised_like_kvgraft():
    cfg = CED.replace(tie_word_embeddings=True)
    hf = KvgraftForCausalLM(KvgraftConfig.from_model_config(cfg))
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert torch.equal(hf.model.rotary.inv_freq, Transformer(cfg).rotary.inv_freq)
    assert abs(hf.model.embed_tokens.weight.std().item() - cfg.initializer_range) < 0.002
    assert all(torch.equal(layer.input_layernorm.weight, torch.ones(cfg.hidden_size)) for layer in hf.model.layers)


def test_clear_errors():
    with pytest.raises(ValueError, match="no 'kvgraft' ModelConfig"):
        KvgraftForCausalLM(KvgraftConfig())
    with pytest.raises(ValueError, match="compress_rate"):
        KvgraftConfig(kvgraft=CED.to_dict() | {"compress_rate": 0})
    hf = KvgraftForCausalLM(KvgraftConfig.from_model_config(CED))
    ids = _ids(CED)
    with pytest.raises(ValueError, match="no tokens"):
        hf(ids, attention_mask=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="num_beams=1"):
        hf.generate(ids, num_beams=2)
    with pytest.raises(ValueError, match="inputs_embeds"):
        hf(inputs_embeds=torch.zeros(1, 2, CED.hidden_size))


@pytest.mark.parametrize("name", ["ced", "mla"])
def test_padded_rows_equal_each_row_alone(name, tmp_path):
    """Left- and right-padded batches: forward logits and greedy generate per row equal the row alone."""
    cfg = CONFIGS[name]
    model = _model(cfg)
    save_pretrained(model, tmp_path / "ckpt", model_type="kvgraft")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, cfg.vocab_size, (n,), generator=g) for n in (13, 5, 20)]
    T = 20
    left = torch.zeros(3, T, dtype=torch.long)
    left_mask = torch.zeros(3, T, dtype=torch.long)
    right, right_mask = left.clone(), left_mask.clone()
    for r, row in enumerate(rows):
        left[r, T - len(row) :], left_mask[r, T - len(row) :] = row, 1
        right[r, : len(row)], right_mask[r, : len(row)] = row, 1
    with torch.no_grad():
        alone = [model(row[None])[0] for row in rows]
        for ids, mask in ((left, left_mask), (right, right_mask)):
            logits = hf(ids, attention_mask=mask).logits
            for r, row in enumerate(rows):
                assert _max_diff(logits[r][mask[r].bool()], alone[r]) < 1e-5
                assert logits[r][~mask[r].bool()].abs().max().item() == 0 if (~mask[r].bool()).any() else True
        out = hf.generate(left, attention_mask=left_mask, max_new_tokens=7, do_sample=False)
    assert torch.equal(out[:, :T], left)
    for r, row in enumerate(rows):
        assert torch.equal(out[r, T:], generate(model, row[None], max_new_tokens=7)[0, len(row) :])
