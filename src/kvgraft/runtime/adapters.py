"""Many LoRA adapters over one served base model: the registry and the mixed-adapter linear layer.

An adapter is a directory written by :func:`kvgraft.adapters.lora.save_adapter` (PEFT's
``adapter_config.json`` + ``adapter_model.safetensors`` and kvgraft's ``kvgraft_adapter.json`` with the
placement, the sharing certificate and the base model's fingerprint). The registry reads it without PEFT
(:func:`read_adapter`: plain LoRA only; anything PEFT can express that this layer would not apply, such
as DoRA, biases or ``modules_to_save``, is refused by name), refuses an adapter trained on another base
(fingerprint), recomputes its certificate from its modules (a file's certificate that disagrees is
refused) and installs it by name while the engine runs.

**Mixed-adapter batches** (S-LoRA / Punica style, plain PyTorch). Every targeted ``nn.Linear`` of the base
is replaced by a :class:`MultiLoraLinear` that holds the deltas of every loaded adapter on it. Its forward
runs the base matmul once over all tokens and adds, per adapter present in the step, ``scale * x A^T B^T``
over that adapter's tokens only (tokens grouped by adapter: one pair of thin matmuls per adapter, then
``index_add``). Which token belongs to which adapter comes from the step's ``BatchContext``
(``kvgraft.model.batch.current_context``): on the packed token axis, ``adapter_tokens()``; inside a layer's
loop over groups (groups are keyed by (new tokens, adapter), so one adapter per group), the active
group's adapter. A call whose input matches neither layout raises instead of guessing.

The one door (absorbed decode's weights) and unloading: :class:`MultiLoraLinear`, :class:`AdapterRegistry`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from kvgraft.adapters.certificate import certify
from kvgraft.adapters.lora import HOST_PREFIX, base_fingerprint, read_meta
from kvgraft.adapters.placement import every_linear
from kvgraft.errors import KvgraftError
from kvgraft.model.batch import BatchContext, current_context
from kvgraft.model.config import ModelConfig
from kvgraft.model.latent import linear_weight
from kvgraft.model.mla import MLAttention
from kvgraft.model.plan import MIXED
from kvgraft.model.transformer import Transformer

_GATHER_MAX_TOKENS = 64  # steps of at most this many tokens gather per-token A/B (decode); longer: per adapter
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# PEFT options that change what a LoRA layer computes beyond y = W x + scale B A x (refused when set)
_UNSUPPORTED = (
    "use_dora",
    "fan_in_fan_out",
    "lora_bias",
    "use_qalora",
    "use_bdlora",
    "modules_to_save",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(KvgraftError, ValueError):
    """An adapter cannot be loaded, used or unloaded (the message says why)."""


class UnknownAdapterError(AdapterError, LookupError):
    """A request names an adapter that is not loaded (the message lists the loaded ones)."""


class AdapterBusyError(AdapterError):
    """An adapter with unfinished requests was asked to unload (without waiting)."""


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise AdapterError(
            f"adapter name {name!r} must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


@dataclass
class LoraWeights:
    """One adapter's delta on one linear: ``scale * B (A x)``; A (r, in), B (out, r)."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    # ((id, version), base weight, merged weight)
    _merged: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B) * self.scale

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight + scale B A`` (cached while ``weight`` is the same tensor at the same version)."""
        key = (id(weight), -1 if weight.is_inference() else weight._version)
        if self._merged is None or self._merged[0] != key or self._merged[1] is not weight:
            with torch.no_grad():
                merged = weight + (self.B @ self.A).to(weight.dtype) * self.scale
            self._merged = (key, weight, merged)
        return self._merged[2]


class MultiLoraLinear(nn.Module):
    """A base ``nn.Linear`` plus the LoRA deltas of every loaded adapter that targets it; each row of a
    step gets its own adapter's delta (see the module docstring). Without a step context, or for base
    rows, it is exactly the base linear.

    The one door. Absorbed latent decode (MLA, the causal encoder-decoder) reads q/kv_b/o weights through
    ``kvgraft.model.latent.linear_weight``, which calls :meth:`MultiLoraLinear.effective_weight`: inside a group it
    returns that group's adapter's merged weight ``W + scale B A`` (cached per adapter, rebuilt if the base weight
    changes), for a base group the base weight. Read outside any group while rows of the step use different adapters
    on this module, it raises: no single weight is right for all rows.
    """

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.loras: dict[str, LoraWeights] = {}
        # (per-row LoraWeights, A (n, r, in), B (n, out, r) with the scales)
        self._stack: tuple[tuple[LoraWeights | None, ...], torch.Tensor, torch.Tensor] | None = None

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def extra_repr(self) -> str:
        return f"adapters={sorted(self.loras)}"

    def lora(self, adapter: object) -> LoraWeights | None:
        """The delta of ``adapter`` (a loaded adapter's name) on this linear; None for the base, MIXED or an
        adapter without one here."""
        return self.loras.get(adapter) if isinstance(adapter, str) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base_layer(x)
        ctx = current_context()
        if not self.loras or not isinstance(ctx, BatchContext) or not ctx.has_adapters:  # only steps name adapters
            return y
        gi = ctx.active_group
        if gi is not None:  # a group's tensor (G, ...), or one adapter's rows of it (each_adapter)
            g = ctx.groups[gi]
            adapter = ctx.active_adapter if ctx.active_adapter is not MIXED else g.adapter
            if adapter is not MIXED:
                lw = self.lora(adapter)
                if lw is None:
                    return y
                if ctx.active_adapter is MIXED and x.shape[0] != g.G:
                    raise RuntimeError(
                        f"adapter layer called inside group {gi} ({g.G} rows) on a tensor of shape "
                        f"{tuple(x.shape)}: cannot tell its rows"
                    )
                return y + lw.delta(x)
            if x.shape[0] != g.G:
                raise RuntimeError(
                    f"adapter layer called inside mixed group {gi} ({g.G} rows) on a tensor of "
                    f"shape {tuple(x.shape)}: cannot tell its rows"
                )
            return self._per_row(x, y, ctx.row_adapters(gi))
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != ctx.num_tokens:
            raise RuntimeError(
                f"adapter layer called outside a group on a tensor of shape {tuple(x.shape)}; "
                f"expected the packed token axis (1, {ctx.num_tokens}, {x.shape[-1]})"
            )
        tokens = ctx.adapter_tokens()
        if len(tokens) > 1 and ctx.num_tokens <= _GATHER_MAX_TOKENS:  # a few tokens of several adapters
            return self._per_row(x[0, :, None], y[0, :, None], ctx.token_adapters())[None, :, 0]
        for adapter, idx in tokens.items():
            lw = self.lora(adapter)
            if lw is None:
                continue
            if idx.numel() == ctx.num_tokens:
                y = y + lw.delta(x)
            else:
                y = y.index_add(1, idx, lw.delta(x.index_select(1, idx)).to(y.dtype))
        return y

    def row_factors(self, adapters: list[object]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-row LoRA factors for rows using ``adapters``: A (n, r, in) and B (n, out, r) with each
        adapter's scale folded into B (zero rows for the base or an adapter without a delta here; ranks
        zero-padded to the largest); None when no row has a delta. Cached while the rows keep their adapters."""
        lws = tuple(self.lora(a) for a in adapters)
        if self._stack is None or len(self._stack[0]) != len(lws) or any(p is not q for p, q in zip(self._stack[0], lws)):
            live = [lw for lw in lws if lw is not None]
            if not live:
                return None
            r = max(lw.A.shape[0] for lw in live)
            A = live[0].A.new_zeros(len(lws), r, self.in_features)
            B = live[0].B.new_zeros(len(lws), self.out_features, r)
            for i, lw in enumerate(lws):
                if lw is not None:
                    A[i, : lw.A.shape[0]] = lw.A
                    B[i, :, : lw.B.shape[1]] = lw.B * lw.scale
            self._stack = (lws, A, B)
        return self._stack[1], self._stack[2]

    def _per_row(self, x: torch.Tensor, y: torch.Tensor, adapters: list[object]) -> torch.Tensor:
        """``y + delta`` for (n, T, in) ``x`` whose row i uses ``adapters[i]`` (None or one without a delta
        here: none): the per-row A and B gathered once (zero-padded to the largest rank, which is exact;
        cached while the rows' adapters stay the same), then two batched matmuls for all rows (Punica's
        gathered matmul in plain PyTorch)."""
        factors = self.row_factors(adapters)
        if factors is None:
            return y
        A, B = factors
        delta = torch.bmm(torch.bmm(x.to(A.dtype), A.transpose(1, 2)), B.transpose(1, 2))
        return y + delta.to(y.dtype)

    def effective_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (weight, bias) the current group's rows see: the one door of ``kvgraft.model.latent``."""
        weight, bias = linear_weight(self.base_layer)
        ctx = current_context()
        if not self.loras or ctx is None or not ctx.has_adapters or ctx.active_adapter is None:
            return weight, bias  # no adapter in the step, or inside ``base_weights``
        if ctx.active_group is None:
            mine = sorted(str(a) for a in ctx.adapter_tokens() if a in self.loras)
            if mine:
                raise RuntimeError(
                    f"a weight read outside a group of a step whose rows use adapters {mine} on this "
                    "module: no single weight is right for every row"
                )
            return weight, bias
        adapter = ctx.active_adapter if ctx.active_adapter is not MIXED else ctx.groups[ctx.active_group].adapter
        if adapter is MIXED:
            if any(a in self.loras for a, _ in ctx.groups[ctx.active_group].adapter_rows):
                raise RuntimeError(
                    "a weight read for a group whose rows use different adapters on this module; "
                    "read it per adapter (BatchContext.each_adapter)"
                )
            return weight, bias
        lw = self.lora(adapter)
        return (weight, bias) if lw is None else (lw.merged(weight), bias)


@dataclass
class AdapterFiles:
    """An adapter read from disk and checked against a base: plain tensors, nothing installed yet."""

    path: Path
    meta: dict[str, Any]
    peft_config: dict[str, Any]
    certificate: dict[str, Any]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module -> (A, B, scale)

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.weights.values())

    @property
    def num_parameters(self) -> int:
        return sum(a.numel() + b.numel() for a, b, _ in self.weights.values())


def _pattern_value(patterns: dict[str, Any] | None, module: str, default: float) -> float:
    """PEFT's rank/alpha patterns: a key matches a module name it ends (after a dot) or equals."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def read_adapter(path: str | Path, config: ModelConfig) -> AdapterFiles:
    """Read and check an adapter directory against a base model ``config`` (a ``ModelConfig``)."""

    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"adapter path {path} is not a directory")
    try:
        meta = read_meta(path)
    except FileNotFoundError as exc:
        raise AdapterError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{path}: kvgraft_adapter.json is not valid JSON ({exc})") from None
    mine = base_fingerprint(config)
    if meta.get("base_fingerprint") != mine:
        raise AdapterError(
            f"adapter {path} was trained on another base model (fingerprint "
            f"{meta.get('base_fingerprint')}, the served base {mine})"
        )
    try:
        peft_config = json.loads((path / "adapter_config.json").read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{path}: adapter_config.json is not valid JSON ({exc})") from None
    if peft_config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {peft_config.get('peft_type')!r} is not LORA")
    bad = [(k, peft_config[k]) for k in _UNSUPPORTED if peft_config.get(k)]
    if peft_config.get("bias", "none") not in (None, "none"):
        bad.append(("bias", peft_config["bias"]))
    if bad:
        key, value = bad[0]
        raise AdapterError(
            f"{path}: adapter_config.json sets {key}={value!r}, which the serving adapter layer does not apply (plain LoRA only)"
        )
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise AdapterError(f"{path} has no adapter_model.safetensors")
    try:
        state = load_file(str(file))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"{file}: not a readable safetensors file ({exc})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{file}: tensor {key!r} is not a LoRA A/B weight (plain LoRA only)")
        module = m["module"]
        if module.startswith(HOST_PREFIX):
            module = module[len(HOST_PREFIX) :]
        pairs.setdefault(module, {})[m["which"]] = t
    if not pairs:
        raise AdapterError(f"{file} holds no LoRA weights")
    known = set(every_linear(config))
    alpha = float(peft_config.get("lora_alpha", 8))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for module, ab in sorted(pairs.items()):
        if module not in known:
            raise AdapterError(f"{path}: module {module!r} is not a projection of the base model")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: module {module!r} has lora_{'A' if 'A' in ab else 'B'} only")
        A, B = ab["A"], ab["B"]
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise AdapterError(f"{path}: module {module!r} has LoRA shapes A {tuple(A.shape)}, B {tuple(B.shape)}")
        if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
            raise AdapterError(f"{path}: module {module!r} has non-finite LoRA weights")
        r = A.shape[0]
        a = float(_pattern_value(peft_config.get("alpha_pattern"), HOST_PREFIX + module, alpha))
        scale = a / math.sqrt(r) if peft_config.get("use_rslora") else a / r
        weights[module] = (A, B, scale)
    cert = certify(config, sorted(weights)).to_dict()
    stated = meta.get("certificate")
    if stated is not None and stated != cert:
        raise AdapterError(
            f"{path}: the certificate in kvgraft_adapter.json does not match the adapter's modules "
            f"(recomputed: untouched {cert['untouched']}, touched {cert['touched']})"
        )
    return AdapterFiles(path, meta, peft_config, cert, weights)


@dataclass
class Adapter:
    """A loaded adapter."""

    name: str
    path: Path
    meta: dict[str, Any]
    certificate: dict[str, Any]
    modules: list[str]
    rank: int
    num_parameters: int
    draining: bool = False  # unloading once its requests finish; new requests are refused

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "modules": len(self.modules),
            "rank": self.rank,
            "parameters": self.num_parameters,
            "placement": self.meta.get("placement"),
            "certificate": self.certificate,
            "draining": self.draining,
        }


class AdapterRegistry:
    """The adapters loaded on one served model, by name. Not thread-safe: call it from the engine's thread.

    Unloading: :meth:`AdapterRegistry.unload` removes an adapter's deltas (a linear left with none is put back as
    the plain ``nn.Linear``). The engine decides when that is allowed (see
    ``kvgraft.runtime.engine.Engine.unload_adapter``: refused while requests use it, or deferred with ``wait=True``
    until they finish).
    """

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.adapters: dict[str, Adapter] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def __len__(self) -> int:
        return len(self.adapters)

    def names(self) -> list[str]:
        return list(self.adapters)

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(self.adapters) or "none"
            raise UnknownAdapterError(f"unknown adapter {name!r}; loaded adapters: {loaded}")
        return adapter

    def read(self, path: str | Path) -> AdapterFiles:
        """Read and check an adapter against this registry's base (safe to call from any thread)."""
        return read_adapter(path, self.model.config)

    def load(self, name: str, source: str | Path | AdapterFiles) -> Adapter:
        """Install adapter ``name`` from a directory (or files already read). Atomic: on error nothing changes."""
        check_name(name)
        if name in self.adapters:
            state = " (unloading)" if self.adapters[name].draining else ""
            raise AdapterError(f"adapter {name!r} is already loaded{state}; unload it first")
        files = source if isinstance(source, AdapterFiles) else self.read(source)
        ref = next(self.model.parameters())
        plan = []
        for module, (A, B, scale) in files.weights.items():
            layer = self.model.get_submodule(module)
            base = layer.base_layer if isinstance(layer, MultiLoraLinear) else layer
            if type(base) is not nn.Linear and not getattr(type(base), "same_function_as_linear", False):
                raise AdapterError(
                    f"module {module} is a {type(layer).__name__}, not a plain nn.Linear (is another "
                    "adapter library attached to the served model?)"
                )
            if A.shape[1] != base.in_features or B.shape[0] != base.out_features:
                raise AdapterError(
                    f"{files.path}: module {module} is ({base.out_features}, {base.in_features}) in "
                    f"the base but the adapter has A {tuple(A.shape)}, B {tuple(B.shape)}"
                )
            plan.append((module, layer, LoraWeights(A.to(ref.device, ref.dtype), B.to(ref.device, ref.dtype), scale)))
        for module, layer, lw in plan:
            if not isinstance(layer, MultiLoraLinear):
                assert isinstance(layer, nn.Linear)  # checked above
                layer = MultiLoraLinear(layer).train(layer.training)
                parent, _, child = module.rpartition(".")
                setattr(self.model.get_submodule(parent), child, layer)
            layer.loras[name] = lw
            layer._stack = None
        adapter = Adapter(
            name, files.path, files.meta, files.certificate, sorted(files.weights), files.rank, files.num_parameters
        )
        self.adapters[name] = adapter
        self._fold_cache_size()
        return adapter

    def unload(self, name: str) -> None:
        """Remove ``name``'s deltas now (callers make sure no request still uses it)."""
        adapter = self.get(name)
        for module in adapter.modules:
            layer = self.model.get_submodule(module)
            if isinstance(layer, MultiLoraLinear):
                layer.loras.pop(name, None)
                layer._stack = None
                if not layer.loras:  # back to the plain linear
                    parent, _, child = module.rpartition(".")
                    setattr(self.model.get_submodule(parent), child, layer.base_layer)
        del self.adapters[name]
        self._fold_cache_size()

    def _fold_cache_size(self) -> None:
        """MLA keeps one fold of its decode weights per adapter a batch may hold, plus the base's."""
        for module in self.model.modules():
            if isinstance(module, MLAttention):  # the attention that folds its decode weights
                module.fold_cache_size = len(self.adapters) + 1
                module._folded.clear()
