"""bench/real_heal.py's pack format: trainable weights as int8 groups with fp16 scales, read back in fp32."""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import real_heal  # noqa: E402


def test_int8_groups_round_trip_within_half_a_step(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(96, 192) * 0.05
    w[3, 70] = 1.0  # an outlier spoils only its own group's step
    packed = real_heal.quantize("w", w)
    assert packed["w"].dtype == torch.int8
    assert packed["w" + real_heal.SCALE].shape == (96, 192 // real_heal.GROUP)
    save_file(packed, str(tmp_path / "attention-00.safetensors"))
    back = real_heal.load_pack(tmp_path)["w"]
    step = w.reshape(96, -1, real_heal.GROUP).abs().amax(-1, keepdim=True) / 127
    err = (back - w).reshape(96, -1, real_heal.GROUP).abs()
    assert torch.all(err <= step * 0.5 * 1.01 + 1e-7)  # fp16 scales: within 1% of half a step
    assert (back - w).norm() / w.norm() < 0.01
    assert err[3, 1].max() > err[4, 1].max()  # the outlier's group is coarser, the others are not


def test_vectors_and_odd_widths_stay_exact(tmp_path):
    b = torch.randn(40)
    odd = torch.randn(8, 50)
    packed = {**real_heal.quantize("b", b), **real_heal.quantize("odd", odd)}
    assert set(packed) == {"b", "odd"}
    save_file(packed, str(tmp_path / "attention-00.safetensors"))
    back = real_heal.load_pack(tmp_path)
    assert torch.equal(back["b"], b) and torch.equal(back["odd"], odd)


def test_older_bf16_packs_still_load(tmp_path):
    w = torch.randn(4, 64)
    save_file({"w": w.to(torch.bfloat16)}, str(tmp_path / "attention-00.safetensors"))
    back = real_heal.load_pack(tmp_path)["w"]
    assert back.dtype == torch.float32 and torch.equal(back, w.to(torch.bfloat16).float())
