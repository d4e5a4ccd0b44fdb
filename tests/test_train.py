"""The shared training loop: exact resume after SIGKILL, schedules, accumulation, atomic checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from kvgraft.model import ModelConfig, Transformer
from kvgraft.train.checkpoint import checkpoint_dirs, find_latest
from kvgraft.train.config import TrainConfig
from kvgraft.train.loop import batch_indices, lm_loss, train

SRC = Path(__file__).resolve().parents[1] / "src"

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_position_embeddings=32
)


class Patterned(torch.utils.data.Dataset):
    """Learnable sequences: arithmetic progressions mod vocab, so the loss really falls."""

    def __init__(self, n: int = 48, seq_len: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.x = (start + step * torch.arange(seq_len + 1)) % vocab

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i, :-1], "labels": self.x[i, 1:]}


def _model(seed: int = 0) -> Transformer:
    m = Transformer(TINY)
    m.init_weights(seed)
    return m


def _cfg(**kw) -> TrainConfig:
    base = dict(
        max_steps=12,
        micro_batch_size=4,
        lr=3e-3,
        warmup_steps=2,
        eval_every=4,
        eval_batches=2,
        save_every=2,
        log_every=1,
        precision="fp32",
        progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def _losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_loss_falls_and_outputs_written(tmp_path):
    result = train(_model(), Patterned(), _cfg(max_steps=30, save_every=10, lr=1e-2), tmp_path, val_data=Patterned(8))
    losses = _losses(tmp_path)
    assert losses[30] < 0.6 * losses[1]
    assert result.step == 30 and result.tokens == 30 * 4 * 16
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert len(checkpoint_dirs(tmp_path)) == 2  # keep_checkpoints
    assert any("val_loss" in r for r in result.history)


CHILD = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from test_train import Patterned, _model, _cfg
    from kvgraft.train.loop import TrainOptions, lm_loss, train

    def slow_loss(model, batch):
        time.sleep({sleep})  # leave the parent time to kill us mid-run
        return lm_loss(model, batch)

    train(_model(), Patterned(), _cfg(), {out!r}, val_data=Patterned(8), options=TrainOptions(loss_fn=slow_loss))
    """
)


def _run_child(out_dir: Path, sleep: float) -> subprocess.Popen:
    script = CHILD.format(tests=str(Path(__file__).parent), out=str(out_dir), sleep=sleep)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen([sys.executable, "-c", script], env=env)


@pytest.mark.slow  # a subprocess killed and restarted (or torchrun): make test-slow, run by CI
def test_exact_resume_after_sigkill(tmp_path):
    straight = tmp_path / "straight"
    train(_model(), Patterned(), _cfg(), straight, val_data=Patterned(8))

    resumed = tmp_path / "resumed"
    child = _run_child(resumed, sleep=0.25)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once a mid-run checkpoint exists and the run has gone past it
        latest = find_latest(resumed)
        if latest is not None and latest.name >= "step_00000004":
            time.sleep(0.4)
            break
        if child.poll() is not None:
            break
        time.sleep(0.05)
    assert child.poll() is None, "the child finished before it could be killed"
    child.send_signal(signal.SIGKILL)
    child.wait()
    killed_at = int(find_latest(resumed).name.split("_")[1])
    assert 4 <= killed_at < 12

    child = _run_child(resumed, sleep=0.0)  # same command again: resumes
    assert child.wait(timeout=300) == 0
    a, b = _losses(straight), _losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
    s_val = [r["val_loss"] for r in map(json.loads, (straight / "log.jsonl").read_text().splitlines()) if "val_loss" in r]
    r_val = [r["val_loss"] for r in map(json.loads, (resumed / "log.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert r_val == pytest.approx(s_val, abs=1e-6)


def test_resume_refuses_a_different_config(tmp_path):
    train(_model(), Patterned(), _cfg(max_steps=4), tmp_path)
    with pytest.raises(ValueError, match=r"lr: 0.003 -> 0.01"):
        train(_model(), Patterned(), _cfg(max_steps=4, lr=1e-2), tmp_path)


def test_resume_may_change_precision_and_saving_and_the_log_says_where(tmp_path):
    train(_model(), Patterned(), _cfg(max_steps=6, precision="bf16", keep_checkpoints=3), tmp_path, val_data=Patterned())
    shutil.rmtree(find_latest(tmp_path))  # as if stopped after step 4 (checkpoints every 2 steps)
    cfg = _cfg(max_steps=6, precision="fp32", save_every=3, eval_every=1)
    result = train(_model(), Patterned(), cfg, tmp_path, val_data=Patterned())
    assert result.step == 6
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    marks = [r for r in rows if "resumed_with" in r]
    assert marks == [{"step": 4, "tokens": marks[0]["tokens"], "resumed_with": {"precision": ["bf16", "fp32"]}}]
    assert json.loads((tmp_path / "train_config.json").read_text())["precision"] == "fp32"
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 5, 6]  # eval_every 4, then 1 after the resume


def test_grad_accumulation_matches_a_bigger_batch(tmp_path):
    a, b = _model(), _model()
    train(a, Patterned(), _cfg(max_steps=1, micro_batch_size=8, grad_accum=1), tmp_path / "a")
    # micro-batches 0 and 1 of size 4 are exactly the first 8 items of the epoch permutation
    train(b, Patterned(), _cfg(max_steps=1, micro_batch_size=4, grad_accum=2), tmp_path / "b")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("preset", ["llama-tiny", "ced-tiny"])
def test_gradient_checkpointing_trains_to_the_same_weights(tmp_path, preset):
    from kvgraft.model.presets import get_preset

    cfg = get_preset(preset).replace(vocab_size=64, max_position_embeddings=32)
    runs = []
    for gc in (False, True):
        m = Transformer(cfg)
        m.init_weights(0)
        train(m, Patterned(), _cfg(max_steps=3, gradient_checkpointing=gc), tmp_path / f"gc{gc}")
        assert m.gradient_checkpointing is gc
        runs.append(m)
    for (name, pa), pb in zip(runs[0].named_parameters(), runs[1].parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_autocast_keeps_fp32_master_weights(tmp_path):
    m = _model()
    train(m, Patterned(), _cfg(max_steps=2, precision="bf16"), tmp_path)
    assert all(p.dtype == torch.float32 for p in m.parameters())


@pytest.mark.parametrize("emulated", [True, False])
def test_bf16_warns_where_the_cpu_would_emulate_it(tmp_path, monkeypatch, emulated):
    """On a CPU whose oneDNN has no bfloat16 path (``packed_dtypes()`` without bfloat16: no AVX-512 BW/VL/DQ,
    AVX-NE-CONVERT or AMX) bf16 autocast runs emulated, far slower than fp32: ``train`` says so once
    and names fp32; where the CPU has the instructions, and in fp32, it says nothing. (The CPU's answer is
    replaced here so both branches run on any machine.)"""
    import kvgraft.train.loop as loop

    dtypes = (torch.float32,) if emulated else (torch.float32, torch.bfloat16)
    monkeypatch.setattr(loop, "packed_dtypes", lambda: dtypes)
    assert loop.bf16_emulated("cpu") is emulated and loop.bf16_emulated("meta") is False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(_model(), Patterned(), _cfg(max_steps=1, precision="bf16"), tmp_path / "bf16")
        train(_model(), Patterned(), _cfg(max_steps=1), tmp_path / "fp32")
    said = [str(w.message) for w in seen if "precision 'bf16'" in str(w.message)]
    if emulated:
        assert len(said) == 1 and "far slower than fp32" in said[0] and "--precision fp32" in said[0]
    else:
        assert said == []


def test_lr_schedule_warmup_then_cosine():
    cfg = _cfg(max_steps=102, warmup_steps=2, lr=1.0, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(0.5)
    assert cfg.lr_at(1) == pytest.approx(1.0)
    assert cfg.lr_at(52) == pytest.approx(0.55)  # half way through the cosine
    assert cfg.lr_at(102) == pytest.approx(0.1)
    values = [cfg.lr_at(s) for s in range(2, 103)]
    assert all(x >= y for x, y in zip(values, values[1:]))


def test_batch_order_is_a_pure_function_of_seed_and_index():
    n, b = 10, 4
    first_epoch = [i for k in range(0, 3) for i in batch_indices(n, 7, k, b)][:n]
    assert sorted(first_epoch) == list(range(n))  # an epoch visits every item once
    assert batch_indices(n, 7, 5, b) == batch_indices(n, 7, 5, b)
    assert batch_indices(n, 7, 0, b) != batch_indices(n, 8, 0, b)


def test_interrupted_checkpoint_leaves_nothing(tmp_path, monkeypatch):
    import kvgraft.train.checkpoint as ck

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        train(_model(), Patterned(), _cfg(max_steps=2, save_every=1), tmp_path)
    assert find_latest(tmp_path) is None
    assert not any(p.name.startswith(".") for p in (tmp_path / "checkpoints").iterdir())


def test_bad_config_values_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"max_steps \(0\)"):
        TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        TrainConfig(max_steps=1, precision="fp8")
    with pytest.raises(ValueError, match="no trainable parameters"):
        m = _model()
        m.requires_grad_(False)
        train(m, Patterned(), _cfg(max_steps=1), tmp_path)


def test_lm_loss_ignores_minus_100():
    m = _model()
    batch = Patterned()[0]
    batch = {k: v[None] for k, v in batch.items()}
    full, _ = lm_loss(m, batch)
    masked = dict(batch, labels=batch["labels"].clone())
    masked["labels"][0, 8:] = -100
    half, _ = lm_loss(m, masked)
    logits = m(batch["input_ids"])[0, :8]
    expected = torch.nn.functional.cross_entropy(logits, batch["labels"][0, :8])
    assert half.item() == pytest.approx(expected.item(), rel=1e-6)
    assert full.item() != pytest.approx(half.item(), rel=1e-6)
