"""Checkpoints tensor by tensor: the lazy reader and the shard writer against the whole-file paths."""

from __future__ import annotations

import json

import pytest
import torch
from factories import sharp_model
from transformers import AutoModelForCausalLM

from kvgraft.atomic import atomic_dir
from kvgraft.errors import CheckpointError
from kvgraft.hf import load_pretrained, save_pretrained
from kvgraft.hf.load import read_state
from kvgraft.hf.shards import CheckpointReader, ShardWriter
from kvgraft.model.config import ModelConfig

TINY = ModelConfig(
    vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=48, max_position_embeddings=64
)


def _resharded(src, dst, max_bytes: int) -> ShardWriter:
    """Copy ``src``'s tensors into ``dst`` through a ShardWriter, one tensor at a time, with the other files."""
    with atomic_dir(dst) as tmp, CheckpointReader(src) as reader:
        for name in ("config.json", "generation_config.json"):
            (tmp / name).write_text((src / name).read_text())
        writer = ShardWriter(tmp, max_shard_bytes=max_bytes)
        for name in reader.keys():
            writer.add(name, reader.get(name))
        writer.close()
    return writer


def test_reader_reads_each_tensor_as_the_whole_file_read_does(tmp_path):
    save_pretrained(sharp_model(TINY), tmp_path / "m")
    whole = read_state(tmp_path / "m")
    with CheckpointReader(tmp_path / "m") as reader:
        assert sorted(reader.keys()) == sorted(whole)
        for name, tensor in whole.items():
            assert reader.shape(name) == tuple(tensor.shape)
            assert torch.equal(reader.get(name), tensor)
        assert reader.get("model.norm.weight", dtype=torch.bfloat16).dtype == torch.bfloat16
        assert sorted(reader.prefixed("model.layers.1.")) == sorted(k for k in whole if k.startswith("model.layers.1."))
        with pytest.raises(CheckpointError, match="has no tensor model.nope"):
            reader.get("model.nope")


def test_sharded_output_loads_identically_here_and_in_transformers(tmp_path):
    model = sharp_model(TINY)
    save_pretrained(model, tmp_path / "one")
    largest = max(p.numel() * 4 for p in model.parameters())
    writer = _resharded(tmp_path / "one", tmp_path / "many", max_bytes=largest)
    files = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert (
        index["metadata"]["total_size"] == writer.total_bytes == sum(t.numel() * 4 for t in read_state(tmp_path / "one").values())
    )
    assert writer.peak_pending_bytes <= largest  # never more than one shard in memory
    assert not list((tmp_path / "many").glob(".shard-*"))
    ids = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_pretrained(tmp_path / "many")(ids)
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "many").eval()(ids).logits
        reference = model(ids)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    torch.testing.assert_close(theirs, reference, rtol=1e-5, atol=1e-5)
    with CheckpointReader(tmp_path / "many") as reader:  # and the reader reads shards as it reads one file
        assert all(torch.equal(reader.get(k), v) for k, v in read_state(tmp_path / "one").items())


def test_one_shard_keeps_the_single_file_name(tmp_path):
    save_pretrained(sharp_model(TINY), tmp_path / "one")
    _resharded(tmp_path / "one", tmp_path / "same", max_bytes=2**30)
    assert sorted(p.name for p in (tmp_path / "same").iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_writer_refuses_bad_arguments_and_repeats(tmp_path):
    with pytest.raises(ValueError, match=r"max_shard_bytes \(0\)"):
        ShardWriter(tmp_path, max_shard_bytes=0)
    with pytest.raises(CheckpointError, match="is not a directory"):
        ShardWriter(tmp_path / "absent")
    writer = ShardWriter(tmp_path)
    writer.add("a", torch.zeros(2))
    with pytest.raises(ValueError, match="tensor a was already written"):
        writer.add("a", torch.ones(2))
    assert writer.close() == {"a": "model.safetensors"}
    with pytest.raises(RuntimeError, match="closed"):
        writer.add("b", torch.zeros(1))


def test_reader_names_a_missing_shard_and_a_corrupt_one(tmp_path):
    model = sharp_model(TINY)
    save_pretrained(model, tmp_path / "one")
    _resharded(tmp_path / "one", tmp_path / "many", max_bytes=max(p.numel() * 4 for p in model.parameters()))
    (tmp_path / "many" / "model-00002-of-{:05d}.safetensors".format(len(list((tmp_path / "many").glob("model-*"))))).write_bytes(
        b"garbage"
    )
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        CheckpointReader(tmp_path / "many")
    next((tmp_path / "many").glob("model-00001-*")).unlink()
    with pytest.raises(CheckpointError, match="is missing from"):
        CheckpointReader(tmp_path / "many")
