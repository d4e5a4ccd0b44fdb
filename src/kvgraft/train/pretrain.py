"""Pretraining recipe: a model config + packed token files + the shared loop -> a Hugging Face checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from accelerate import PartialState
from tokenizers import Tokenizer

from kvgraft.checks import check_int, check_writable
from kvgraft.data import PackedDataset
from kvgraft.errors import ConfigError
from kvgraft.hf import save_pretrained
from kvgraft.hf.config_map import natural_model_type
from kvgraft.model import ModelConfig, Transformer
from kvgraft.model.presets import get_preset
from kvgraft.train.checkpoint import find_latest, load_checkpoint
from kvgraft.train.config import TrainConfig
from kvgraft.train.loop import TrainOptions, TrainResult, train


def check_data_vocab(data_dir: Path, config: ModelConfig, preset: str | None = None) -> None:
    """Refuse (ValueError) data whose tokenizer or token ids do not fit the model's vocabulary, before training.

    Token ids >= ``config.vocab_size`` would crash the embedding mid-run; a tokenizer larger than the
    model's vocabulary would produce them on new text.
    """

    name = f"model preset {preset!r}" if preset else "the model"
    fix = (
        f"prepare the data with --vocab-size {config.vocab_size} (or less), or choose a model whose vocab_size covers the data's"
    )
    tokenizer = data_dir / "tokenizer" / "tokenizer.json"
    if tokenizer.is_file():
        size = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
        if size > config.vocab_size:
            raise ConfigError(
                f"the data in {data_dir} uses a {size}-token vocabulary ({tokenizer}), but {name} has "
                f"vocab_size {config.vocab_size}; {fix}"
            )
    for split in ("train", "validation"):
        path = data_dir / "tokens" / f"{split}.npy"
        tokens = np.load(path, mmap_mode="r")
        if tokens.size and int(tokens.max()) >= config.vocab_size:
            raise ConfigError(
                f"{path} holds token id {int(tokens.max())}, outside the vocabulary of {name} "
                f"(vocab_size {config.vocab_size}); {fix}"
            )


def pretrain(
    data_dir: str | Path,
    out_dir: str | Path,
    model: str | ModelConfig = "llama-8m",
    train_config: TrainConfig | None = None,
    seq_len: int | None = None,
    export: bool = True,
) -> TrainResult:
    """Pretrain a model from scratch on ``data_dir`` (made by ``kvgraft prepare-data``).

    ``data_dir`` holds ``tokens/train.npy``, ``tokens/validation.npy`` and ``tokenizer/``.
    Checkpoints and logs go to ``out_dir``; rerunning the same command resumes. When training
    finishes (or stops early on ``max_time_s``), the final weights are exported in Hugging Face
    format to ``out_dir/final`` together with the tokenizer.
    """
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    config = get_preset(model) if isinstance(model, str) else model
    train_config = train_config or TrainConfig(max_steps=1000)
    if seq_len is None:
        seq_len = config.max_position_embeddings
    check_int("seq_len", seq_len, low=1)
    if seq_len > config.max_position_embeddings:
        raise ConfigError(f"seq_len ({seq_len}) exceeds max_position_embeddings ({config.max_position_embeddings})")
    for name in ("tokens/train.npy", "tokens/validation.npy"):
        if not (data_dir / name).exists():
            raise FileNotFoundError(f"{data_dir / name} is missing; run `kvgraft prepare-data --out {data_dir}` first")
    check_data_vocab(data_dir, config, model if isinstance(model, str) else None)

    check_writable(out_dir / "train_config.json", what="run directory")
    train_ds = PackedDataset(data_dir / "tokens" / "train.npy", seq_len)
    val_ds = PackedDataset(data_dir / "tokens" / "validation.npy", seq_len)

    net = Transformer(config)
    net.init_weights(seed=train_config.seed)
    result = train(
        net,
        train_ds,
        train_config,
        out_dir,
        val_data=val_ds,
        options=TrainOptions(extra_state={"model_config": config.to_dict(), "seq_len": seq_len}),
    )

    state = PartialState()  # the launch's processes (one unless torchrun / accelerate launch): one writer
    if export and state.is_main_process:
        latest = find_latest(out_dir)
        if latest is not None:
            load_checkpoint(latest, net)

        save_pretrained(
            net, out_dir / "final", tokenizer_dir=data_dir / "tokenizer", overwrite=True, model_type=natural_model_type(config)
        )
        summary = {
            "steps": result.step,
            "tokens": result.tokens,
            "train_loss": result.train_loss,
            "val_loss": result.val_loss,
            "val_ppl": math.exp(result.val_loss) if result.val_loss else None,
            "seq_len": seq_len,
            "stopped_early": result.stopped_early,
        }
        (out_dir / "final" / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    state.wait_for_everyone()
    return result
