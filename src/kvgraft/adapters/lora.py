"""LoRA adapters on kvgraft models, injected, saved and loaded by PEFT, plus what PEFT lacks.

PEFT does the LoRA layers and the files: an adapter directory holds PEFT's own ``adapter_config.json``
and ``adapter_model.safetensors`` (loadable with ``peft.PeftModel.from_pretrained``), plus
``kvgraft_adapter.json`` with what PEFT has no place for: the placement by meaning, the exact modules it
compiled to, the sharing certificate and the base model: its config fingerprint, a fingerprint of its
weights and a portable reference (a shipped model's name, or a path relative to the adapter directory;
``kvgraft.adapters.fingerprint``), so a copied or moved adapter directory loads on another machine and
refuses any other base.

The base is hosted as ``AdapterHost.model`` so module names are transformers' (``model.layers.4.self_attn.
q_proj``): the same adapter files load on kvgraft's model, on ``KvgraftForCausalLM`` (the transformers
Auto classes) and, for a stock DeepSeek-V3 export, on ``DeepseekV3ForCausalLM`` (see
``kvgraft.hf.deepseek.adapters``). PEFT's ``target_modules`` gets the compiled full names, so the adapter sits
exactly where the placement says.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvgraft.adapters.certificate import Certificate, certify
from kvgraft.adapters.fingerprint import (  # base_fingerprint: re-exported here, its old home
    base_fingerprint,
    base_record,
    base_reference,
    check_base_weights,
)
from kvgraft.adapters.placement import Placement, compile_placement
from kvgraft.atomic import atomic_dir
from kvgraft.checks import check_int
from kvgraft.errors import ConfigError
from kvgraft.model.config import ModelConfig
from kvgraft.model.shapes import num_parameters, parameter_shapes
from kvgraft.model.transformer import Transformer

META_FILE = "kvgraft_adapter.json"
FORMAT_VERSION = 2  # 2: "base" is {name, reference | path (relative to the adapter), fingerprint, sample}
HOST_PREFIX = "model."
INITS = ("default", "gaussian")


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA hyper-parameters. ``alpha`` defaults to 2 x rank (the choice of Mind Lab's article on LoRA placement)."""

    rank: int = 16
    alpha: float | None = None
    dropout: float = 0.0
    init: str = "default"  # PEFT's: B = 0 (a fresh adapter changes nothing), A Kaiming-uniform | gaussian

    def __post_init__(self) -> None:
        check_int("rank", self.rank, low=1)
        alpha = 2.0 * self.rank if self.alpha is None else self.alpha
        object.__setattr__(self, "alpha", alpha)
        if not alpha > 0:
            raise ConfigError(f"alpha ({alpha!r}) must be > 0")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout ({self.dropout!r}) must be in [0, 1)")
        if self.init not in INITS:
            raise ConfigError(f"init {self.init!r} is not one of {', '.join(INITS)}")


class AdapterHost(nn.Module):
    """kvgraft's Transformer under ``model`` (transformers' names); the forward is the Transformer's."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def add_adapter(model: Transformer, placement: Placement, cfg: AdapterConfig | None = None):
    """Wrap ``model`` (kept in place: its modules get LoRA layers) with a fresh PEFT LoRA adapter at
    ``placement``; returns the ``peft.PeftModel``. Base weights are frozen, only the adapter trains."""
    from peft import LoraConfig, get_peft_model  # lazy: PEFT is heavy and only adapter training/loading needs it

    cfg = cfg or AdapterConfig()
    modules = compile_placement(model.config, placement)
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # PEFT annotates an int; float alphas work
        lora_dropout=cfg.dropout,
        bias="none",
        target_modules=[HOST_PREFIX + m for m in modules],
        init_lora_weights=True if cfg.init == "default" else "gaussian",
    )
    meta = _meta(model, placement, modules, cfg)  # the base's weights fingerprinted before LoRA wraps them
    peft_model: Any = get_peft_model(AdapterHost(model), lora)  # Any: PEFT versions type it differently
    peft_model.kvgraft_meta = meta  # our record rides on the PeftModel
    return peft_model


def _meta(model: Transformer, placement: Placement, modules: list[str], cfg: AdapterConfig) -> dict:
    config = model.config
    return {
        "format_version": FORMAT_VERSION,
        "base_fingerprint": base_fingerprint(config),
        "base": base_record(model),
        "base_config": config.to_dict(),
        "placement": placement.to_dict(),
        "modules": modules,
        "adapter": asdict(cfg),
        "certificate": certify(config, modules).to_dict(),
    }


def adapter_modules(peft_model) -> list[str]:
    return list(peft_model.kvgraft_meta["modules"])


def certificate_of(peft_model) -> Certificate:
    return Certificate.from_dict(peft_model.kvgraft_meta["certificate"])


def transformer_of(peft_model) -> Transformer:
    """The kvgraft Transformer inside a PeftModel (its modules carry the LoRA layers)."""
    return peft_model.get_base_model().model


def save_adapter(peft_model, out_dir: str | Path, extra: dict | None = None, base: str | Path | None = None) -> Path:
    """Write PEFT's files plus ``kvgraft_adapter.json`` into ``out_dir`` atomically (complete or absent).
    ``base``: the base model's directory, recorded portably (a shipped model by name, any other by its path
    relative to ``out_dir``), never as an absolute path."""

    out = Path(out_dir)
    meta = dict(peft_model.kvgraft_meta, **(extra or {}))
    if base is not None:
        given = meta.get("base")
        recorded: dict[str, Any] = given if isinstance(given, dict) else {}
        meta["base"] = base_reference(base, out) | {k: v for k, v in recorded.items() if k not in ("name", "path", "reference")}
    with atomic_dir(out, overwrite=True) as tmp:
        peft_model.save_pretrained(str(tmp))
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return out


def read_meta(adapter_dir: str | Path) -> dict:
    path = Path(adapter_dir) / META_FILE
    if not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter_dir} is not an adapter directory (no adapter_config.json)")
    if not path.is_file():
        raise FileNotFoundError(
            f"{adapter_dir} has no {META_FILE}: not written by kvgraft (PEFT files alone carry no placement or certificate)"
        )
    return json.loads(path.read_text())


def check_base(meta: dict, model: Transformer, adapter_dir: str | Path) -> None:
    """Refuse (ValueError naming both fingerprints) a ``model`` that is not the adapter's base: another
    architecture, or the same one with other weights. An adapter written before weights were fingerprinted
    is checked on the architecture alone, with a warning."""

    mine = base_fingerprint(model.config)
    if meta.get("base_fingerprint") != mine:
        raise ConfigError(
            f"adapter {adapter_dir} was trained on another base model (fingerprint "
            f"{meta.get('base_fingerprint')}, this model {mine})"
        )
    if not check_base_weights(meta, model, adapter_dir):
        where = f" and records its base as {meta['base']!r}" if isinstance(meta.get("base"), str) else ""
        warnings.warn(
            f"adapter {adapter_dir} was written by an older kvgraft: it has no fingerprint of its base's "
            f"weights{where}; only the architecture was checked. Save it again (save_adapter with "
            "base=...) to make it portable and checked",
            UserWarning,
            stacklevel=3,
        )


def load_adapter(model: Transformer, adapter_dir: str | Path, trainable: bool = False):
    """Attach a saved adapter to ``model``; refuses an adapter trained on another base (``check_base``)."""
    from peft import PeftModel  # lazy: PEFT is heavy and only adapter training/loading needs it

    meta = read_meta(adapter_dir)
    check_base(meta, model, adapter_dir)
    peft_model: Any = PeftModel.from_pretrained(AdapterHost(model), str(adapter_dir), is_trainable=trainable)
    peft_model.kvgraft_meta = meta  # our record rides on the PeftModel
    return peft_model


def trainable_parameters(peft_model) -> int:
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def dry_run(config: ModelConfig, placement: Placement, cfg: AdapterConfig | None = None) -> dict:
    """What ``add_adapter`` would do, without building anything: every matched module with its shape and
    LoRA parameter count, the total, and the certificate."""

    cfg = cfg or AdapterConfig()
    modules = compile_placement(config, placement)
    shapes = parameter_shapes(config)
    rows = []
    for m in modules:
        out_f, in_f = shapes[f"{m}.weight"]
        rows.append({"module": HOST_PREFIX + m, "in": in_f, "out": out_f, "lora_params": cfg.rank * (in_f + out_f)})
    return {
        "modules": rows,
        "trainable_parameters": sum(r["lora_params"] for r in rows),
        "base_parameters": num_parameters(config),
        "certificate": certify(config, modules).to_dict(),
    }


@torch.no_grad()
def randomize_adapter(peft_model, scale: float = 0.05, seed: int = 0) -> None:
    """Give every LoRA A and B random non-zero values (tests, certificate checks)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=g) * scale)
