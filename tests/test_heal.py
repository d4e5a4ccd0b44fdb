"""Healing: the seed's recipe on the shared loop, distillation, attention-only, fp32 down-projections, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.hf import load_pretrained, save_pretrained
from kvgraft.model import ModelConfig, Transformer
from kvgraft.train.config import TrainConfig
from kvgraft.train.heal import HealConfig, HealOptions, heal

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture()
def setup(tmp_path):
    """An original tiny model, its 4x MLA graft (kvgraft format) and a prepared-data-like directory."""
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=32,
        initializer_range=0.3,
    )
    original = Transformer(cfg)
    original.init_weights(0)
    orig_dir = save_pretrained(original, tmp_path / "original")
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 64, (4, 32), generator=g)
    mla = graft_mla(original, GraftConfig(kv_lora_rank=4, qk_rope_head_dim=4), calib, progress=False)
    mla_dir = save_pretrained(mla, tmp_path / "mla", model_type="kvgraft")
    data = tmp_path / "data" / "tokens"
    data.mkdir(parents=True)
    stream = (np.arange(20000) * 7 % 61).astype(np.uint16)  # a learnable sequence
    np.save(data / "train.npy", stream)
    np.save(data / "validation.npy", stream[:2000])
    return orig_dir, mla_dir, tmp_path / "data"


def _tc(**kw) -> TrainConfig:
    base = dict(
        max_steps=6,
        micro_batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        eval_every=3,
        eval_batches=2,
        save_every=2,
        log_every=1,
        precision="fp32",
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize("loss", ["lm", "kl", "mix"])
def test_heal_runs_and_writes_a_loadable_model(setup, tmp_path, loss):
    orig_dir, mla_dir, data = setup
    out = tmp_path / f"heal-{loss}"
    result = heal(mla_dir, out, data, HealOptions(teacher=orig_dir, heal_config=HealConfig(loss=loss), train_config=_tc()))
    assert result.step == 6
    losses = _losses(out)
    assert losses[6] < losses[1]
    healed = load_pretrained(out / "final")
    assert healed.config.attention_kinds == ("mla", "mla")
    record = json.loads((out / "final" / "heal.json").read_text())
    assert record["heal"]["loss"] == loss and record["tokens"] == 6 * 4 * 32


def test_kl_needs_a_teacher(setup, tmp_path):
    _, mla_dir, data = setup
    with pytest.raises(ValueError, match="needs a teacher"):
        heal(mla_dir, tmp_path / "x", data, HealOptions(heal_config=HealConfig(loss="kl"), train_config=_tc()))


def test_kl_of_a_model_against_itself_is_zero(setup):
    from kvgraft.train.heal import distillation_loss

    orig_dir, _, _ = setup
    model = load_pretrained(orig_dir)
    ids = torch.randint(0, 64, (2, 16))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    loss, metrics = distillation_loss(load_pretrained(orig_dir), HealConfig(loss="kl"))(model, batch)
    assert abs(loss.item()) < 1e-6 and metrics["ce"] > 1.0


def test_attention_only_freezes_everything_else(setup, tmp_path):
    orig_dir, mla_dir, data = setup
    before = load_pretrained(mla_dir).state_dict()
    out = tmp_path / "attn"
    heal(mla_dir, out, data, HealOptions(heal_config=HealConfig(attention_only=True), train_config=_tc(max_steps=3)))
    after = load_pretrained(out / "final").state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".self_attn." in k for k in changed)
    assert any("mlp" in k for k in before) and not any("mlp" in k for k in changed)


def test_attention_only_checkpoints_hold_the_attention_and_resume(setup, tmp_path):
    """An attention-only heal checkpoints only what trains (a 135M model's checkpoint is its attention, not the
    whole model), and a run resumed from such a checkpoint ends where the straight run does."""
    import shutil

    from safetensors.torch import load_file

    from kvgraft.train.checkpoint import checkpoint_dirs

    _, mla_dir, data = setup
    straight = tmp_path / "straight"
    tc = _tc(max_steps=4, save_every=2, eval_every=2)
    heal(mla_dir, straight, data, HealOptions(heal_config=HealConfig(attention_only=True), train_config=tc))
    ckpts = checkpoint_dirs(straight)
    assert [c.name for c in ckpts][-1].endswith("00000004")
    saved = load_file(str(ckpts[-1] / "model.safetensors"))
    model = load_pretrained(mla_dir)
    attention = {n for n, _ in model.named_parameters() if ".self_attn." in n}
    assert set(saved) == attention
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(checkpoint_dirs(resumed)[-1])  # back to step 2: the rerun trains steps 3 and 4 again
    heal(mla_dir, resumed, data, HealOptions(heal_config=HealConfig(attention_only=True), train_config=tc))
    a, b = load_pretrained(straight / "final").state_dict(), load_pretrained(resumed / "final").state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def test_a_weights_only_checkpoint_resumes_only_when_it_says_so(setup, tmp_path):
    """A checkpoint carried without its optimizer state (bench/real_heal.py's packs) resumes with fresh AdamW
    moments only if state.json says why, and the log records it; a missing optimizer.pt otherwise is an error."""
    from kvgraft.train.checkpoint import checkpoint_dirs

    _, mla_dir, data = setup
    import shutil

    run = tmp_path / "run"
    longer = _tc(max_steps=4, save_every=2)
    heal(mla_dir, run, data, HealOptions(heal_config=HealConfig(attention_only=True), train_config=longer))
    shutil.rmtree(checkpoint_dirs(run)[-1])  # back to step 2
    ckpt = checkpoint_dirs(run)[-1]
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match="optimizer_reset"):
        heal(mla_dir, run, data, HealOptions(heal_config=HealConfig(attention_only=True), train_config=longer))
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "optimizer_reset": "carried without it"}))
    result = heal(mla_dir, run, data, HealOptions(heal_config=HealConfig(attention_only=True), train_config=longer))
    assert result.step == 4
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert any(r.get("resumed_with", {}).get("optimizer") == "carried without it" for r in rows)


def test_down_projections_stay_fp32_with_bf16_weights(setup, tmp_path, monkeypatch):
    """Weights held in bf16 except the latent down-projections, whose weights and gradients stay fp32."""
    import kvgraft.train.heal as heal_mod

    seen: dict[str, torch.dtype] = {}
    real_train = heal_mod.train

    def spy(model, *args, **kwargs):
        for name, p in model.named_parameters():
            p.register_hook(lambda g, name=name: seen.__setitem__(name, g.dtype))
        return real_train(model, *args, **kwargs)

    monkeypatch.setattr(heal_mod, "train", spy)
    _, mla_dir, data = setup
    heal(mla_dir, tmp_path / "bf16", data, HealOptions(train_config=_tc(max_steps=2, precision="bf16"), dtype=torch.bfloat16))
    down = [n for n in seen if "kv_a_proj" in n]
    assert down and all(seen[n] == torch.float32 for n in down)
    assert seen["layers.0.mlp.up_proj.weight"] == torch.bfloat16


def test_token_budget_sets_the_steps(setup, tmp_path):
    _, mla_dir, data = setup
    result = heal(
        mla_dir,
        tmp_path / "budget",
        data,
        HealOptions(heal_config=HealConfig(tokens=5 * 4 * 32), train_config=_tc(max_steps=1000)),
    )
    assert result.step == 5


CHILD = textwrap.dedent(
    """
    import time, sys
    from pathlib import Path
    import kvgraft.train.heal as heal_mod
    from kvgraft.train.config import TrainConfig
    real = heal_mod.lm_loss
    def slow(model, batch):
        time.sleep({sleep})
        return real(model, batch)
    heal_mod.lm_loss = slow
    tc = TrainConfig(max_steps=8, micro_batch_size=4, lr=3e-3, warmup_steps=1, eval_every=4, eval_batches=2,
                     save_every=2, log_every=1, precision="fp32", progress=False)
    heal_mod.heal(Path({mla!r}), Path({out!r}), Path({data!r}), heal_mod.HealOptions(train_config=tc))
    """
)


@pytest.mark.slow  # a subprocess killed and restarted (or torchrun): make test-slow, run by CI
def test_heal_resumes_exactly_after_sigkill(setup, tmp_path):
    _, mla_dir, data = setup
    straight = tmp_path / "straight"
    heal(mla_dir, straight, data, HealOptions(train_config=_tc(max_steps=8, eval_every=4)))
    resumed = tmp_path / "resumed"
    env = {**os.environ, "PYTHONPATH": str(SRC)}

    def child(sleep: float) -> subprocess.Popen:
        code = CHILD.format(sleep=sleep, mla=str(mla_dir), out=str(resumed), data=str(data))
        return subprocess.Popen([sys.executable, "-c", code], env=env)

    from kvgraft.train.checkpoint import find_latest

    proc = child(0.3)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        latest = find_latest(resumed)
        if latest is not None and latest.name >= "step_00000004":
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the heal finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert child(0.0).wait(timeout=300) == 0
    a, b = _losses(straight), _losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6)
    ha = load_pretrained(straight / "final").state_dict()
    hb = load_pretrained(resumed / "final").state_dict()
    for k in ha:
        torch.testing.assert_close(ha[k], hb[k], atol=1e-6, rtol=0)


def test_copy_windows_repeat_their_opening_span_and_keep_the_rest():
    from kvgraft.data import CopyWindows, PackedDataset

    stream = np.arange(200, dtype=np.uint16)
    base = PackedDataset(stream, 16)
    ds = CopyWindows(base, 0.5, 5)
    assert len(ds) == len(base) and [ds.is_copy(i) for i in range(6)] == [False, True, False, True, False, True]
    assert torch.equal(ds[0]["input_ids"], base[0]["input_ids"])
    item = ds[1]  # window 1 reads tokens 16..32: A = 16..20, then A again, then 21..26
    full = torch.cat([item["input_ids"], item["labels"][-1:]]).tolist()
    assert full == [*range(16, 21), *range(16, 21), *range(21, 28)]
    assert torch.equal(item["labels"][:-1], item["input_ids"][1:])
    every = CopyWindows(base, 1.0, 8)
    assert all(every.is_copy(i) for i in range(len(every)))
    assert torch.cat([every[2]["input_ids"], every[2]["labels"][-1:]]).tolist() == [*range(32, 40), *range(32, 40), 40]
    assert not any(CopyWindows(base, 0.0, 8).is_copy(i) for i in range(len(base)))
    assert sum(CopyWindows(base, 0.25, 4).is_copy(i) for i in range(12)) == 3


@pytest.mark.parametrize(
    "fraction, span, match",
    [
        (1.5, 4, r"copy fraction \(1.5\) must be a number in \[0, 1\]"),
        (0.5, 9, r"copy span \(9\) must be an integer in \[1, seq_len // 2 = 8\]"),
        (0.5, 0, r"copy span \(0\)"),
    ],
)
def test_copy_windows_refuse_bad_values(fraction, span, match):
    from kvgraft.data import CopyWindows, PackedDataset

    with pytest.raises(ValueError, match=match):
        CopyWindows(PackedDataset(np.arange(100, dtype=np.uint16), 16), fraction, span)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"copy_fraction": -0.1}, r"copy_fraction \(-0.1\) must be a number in \[0, 1\]"),
        ({"copy_fraction": True}, r"copy_fraction \(True\)"),
        ({"copy_fraction": 0.5, "copy_span": 0}, r"copy_span \(0\) must be a positive integer"),
        ({"copy_span": 8}, r"copy_span \(8\) needs a copy_fraction above 0"),
    ],
)
def test_heal_config_refuses_bad_copy_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        HealConfig(**kw)


def test_heal_with_copy_windows_trains_and_records_them(setup, tmp_path):
    orig_dir, mla_dir, data = setup
    with pytest.raises(ValueError, match=r"copy_span \(20\) must be at most half the sequence length \(32 // 2 = 16\)"):
        heal(
            mla_dir,
            tmp_path / "bad",
            data,
            HealOptions(
                teacher=orig_dir,
                heal_config=HealConfig(loss="kl", copy_fraction=0.5, copy_span=20),
                train_config=_tc(),
                seq_len=32,
            ),
        )
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "copy"
    hc = HealConfig(loss="kl", copy_fraction=0.5, copy_span=12)
    result = heal(mla_dir, out, data, HealOptions(teacher=orig_dir, heal_config=hc, train_config=_tc()))
    assert result.step == 6
    record = json.loads((out / "final" / "heal.json").read_text())
    assert record["heal"]["copy_fraction"] == 0.5 and record["heal"]["copy_span"] == 12
    assert "0.5 of the windows repeat their first 12 tokens" in (out / "final" / "README.md").read_text()
