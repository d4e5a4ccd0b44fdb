"""Linear layers whose weights are pre-packed for oneDNN, for inference on the CPU.

A matmul on the CPU spends part of its time re-laying the weight out for the kernel; oneDNN can do that once
(torch's ``mkldnn._reorder_linear_weight``, the prepack torch's inductor applies when it freezes a model for
the CPU, and the one vLLM's CPU backend applies to every linear layer). :func:`pack_linears` turns a model's
plain ``nn.Linear`` layers into :class:`PackedLinear`, an ``nn.Linear`` (same parameters, same state dict)
whose forward uses a packed copy of the weight when nothing needs a gradient and the input is on the CPU in
the weight's dtype, and is ``F.linear`` otherwise (training, other devices). The packed copy is made on the
first such call and remade when the weight changes (its storage or version), so loading weights, merging an
adapter or a training step in between is never served stale.

Cost: one packed copy per linear layer (the linear weights' bytes again; :func:`packed_bytes`). Results
differ from ``F.linear`` by the order of accumulation only (relative ~1e-6 in float32), not bit for bit.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvgraft.errors import ConfigError


@functools.cache
def packed_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs on this CPU: float32, and bfloat16 where the CPU has the instructions oneDNN's
    bfloat16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU it raises, so such weights run
    ``F.linear``)."""
    try:
        bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        bf16 = False
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


@functools.cache
def packing_available() -> bool:
    """Whether this torch build packs and runs linear weights through oneDNN (checked once, against
    ``F.linear``)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 16, generator=gen), torch.randn(3, 16, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-5))


# packed copies live outside the modules (deepcopy, pickle and state dicts never see an opaque oneDNN tensor; a copy
# of a packed model packs on its first inference call): module -> (what it was packed from, packed weight)
_PACKED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, int, int], torch.Tensor]] = weakref.WeakKeyDictionary()


def _source(w: torch.Tensor) -> tuple[Any, int, int]:
    """What a packed copy was made from: the weight object, its storage and its version (in-place writes)."""
    return weakref.ref(w), w.data_ptr(), w._version


def _current(entry: tuple[tuple[Any, int, int], torch.Tensor | None] | None, w: torch.Tensor) -> bool:
    """Whether ``entry`` was packed from ``w`` as it is now (weak references compared by identity: ``==`` on
    two live ones compares the tensors)."""
    return entry is not None and entry[0][0]() is w and entry[0][1:] == (w.data_ptr(), w._version)


class PackedLinear(nn.Linear):
    """``nn.Linear`` with a oneDNN-packed copy of its weight for CPU inference (module docstring)."""

    same_function_as_linear = True  # adapters may wrap it as a plain nn.Linear (only the kernel differs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not _packed_path(x, w):
            return F.linear(x, w, self.bias)
        entry = _PACKED.get(self)
        packed = entry[1] if entry is not None and _current(entry, w) else self.pack()
        bias = None if self.bias is None else self.bias.detach()
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return y

    def pack(self) -> torch.Tensor:
        """(Re)make and return the packed copy of the current weight (a CPU float32 or bfloat16 weight)."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in packed_dtypes():
            accepted = "/".join(str(d).removeprefix("torch.") for d in packed_dtypes())
            raise ConfigError(f"only CPU {accepted} weights pack on this machine; this one is {w.dtype} on {w.device}")
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        _PACKED[self] = (_source(w), packed)
        return packed

    @property
    def packed(self) -> bool:
        """Whether a packed copy of the current weight is held."""
        return _current(_PACKED.get(self), self.weight)

    def unpack(self) -> None:
        """Drop the packed copy (the next inference call packs again)."""
        _PACKED.pop(self, None)
        _FUSED.pop(self, None)


# several PackedLinear layers read by one matmul (q/k/v, gate/up): first module -> (modules, what each weight was
# packed from, packed concatenated weight, concatenated bias or None, output widths)
_FUSED: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _packed_path(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x @ w.T`` may run on a packed weight: CPU, the weight's dtype (float32, or bfloat16 where this CPU
    packs it: :func:`packed_dtypes`), no gradient."""
    return (
        x.device.type == "cpu"
        and x.dtype == w.dtype
        and w.dtype in packed_dtypes()
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def linears(x: torch.Tensor, *modules: nn.Module) -> list[torch.Tensor]:
    """``[m(x) for m in modules]``; when every module is a :class:`PackedLinear` on the packed path, one matmul
    over their weights concatenated (packed once, remade when any weight changes; the modules' own packed
    copies are then dropped, so the weights are not held packed twice), its output split back (views)."""
    if not all(type(m) is PackedLinear for m in modules):
        return [m(x) for m in modules]
    mods = cast(tuple[PackedLinear, ...], modules)
    if not _packed_path(x, mods[0].weight):
        return [m(x) for m in mods]
    entry = _FUSED.get(mods[0])
    if entry is None or entry[0] != mods or not all(_current((src, None), m.weight) for src, m in zip(entry[1], mods)):
        entry = _fuse(mods)
        if entry is None:
            return [m(x) for m in modules]
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, entry[2], entry[3], "none", [], "")
    return list(y.split_with_sizes(entry[4], dim=-1))


def packed_weight(*modules: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(packed weight, bias or None) that :func:`linears` (several modules: their weights concatenated) or
    :meth:`PackedLinear.forward` (one) multiplies a CPU float input by, packed anew if a weight changed; None
    where those modules do not take the packed path (not all :class:`PackedLinear`, gradients, other dtypes)."""
    if not all(type(m) is PackedLinear for m in modules):
        return None
    mods = cast(tuple[PackedLinear, ...], modules)
    w = mods[0].weight
    if w.device.type != "cpu" or w.dtype not in packed_dtypes() or (torch.is_grad_enabled() and w.requires_grad):
        return None
    if len(mods) == 1:
        entry = _PACKED.get(mods[0])
        packed = entry[1] if entry is not None and _current(entry, w) else mods[0].pack()
        return packed, None if mods[0].bias is None else mods[0].bias.detach()
    fused = _FUSED.get(mods[0])
    if fused is None or fused[0] != mods or not all(_current((src, None), m.weight) for src, m in zip(fused[1], mods)):
        fused = _fuse(mods)
        if fused is None:
            return None
    return fused[2], fused[3]


def _fuse(modules: tuple[PackedLinear, ...]) -> tuple[Any, ...] | None:
    """Pack ``modules``' weights concatenated (their own packed copies dropped) and remember it under the first;
    None when their dtypes differ (each then runs on its own)."""
    ws = [m.weight for m in modules]
    if any(w.dtype != ws[0].dtype for w in ws):
        return None
    biases = [m.bias for m in modules]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, ws)])
    )
    weight = torch.cat([w.detach() for w in ws])
    entry = (
        modules,
        [_source(w) for w in ws],
        torch.ops.mkldnn._reorder_linear_weight(weight, None),
        bias,
        [w.shape[0] for w in ws],
    )
    _FUSED[modules[0]] = entry
    for m in modules:
        _PACKED.pop(m, None)
    return entry


def adjacent(*parts: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose consecutive last-axis slices ``parts`` are (the output of :func:`linears` before its
    split, read back from the views), or None when they are not neighbouring columns of one tensor."""
    first = parts[0]
    stride, lead, itemsize = first.stride(), first.shape[:-1], first.element_size()
    if stride[-1] != 1:
        return None
    ptr = first.data_ptr()
    for p in parts:  # addresses, not view bases (inference mode keeps no view bases)
        if p.data_ptr() != ptr or p.stride() != stride or p.shape[:-1] != lead or p.dtype != first.dtype:
            return None
        ptr += p.shape[-1] * itemsize
    try:  # refused past the end of first's storage: whatever lies at those addresses then is not first's
        return first.as_strided((*lead, (ptr - first.data_ptr()) // itemsize), stride)
    except RuntimeError:
        return None


def pack_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`PackedLinear` in place (the same module objects,
    parameters and state dict) and pack their weights now (so a memory budget measured next sees them);
    returns how many. Nothing changes when oneDNN packing is unavailable (0)."""
    if not packing_available():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
            if module.weight.device.type == "cpu" and module.weight.dtype in packed_dtypes():
                PackedLinear.pack(module)  # type: ignore[arg-type]
            n += 1
    return n


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears`: plain ``nn.Linear`` again, packed copies freed; returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            module.unpack()
            module.__class__ = nn.Linear  # type: ignore[assignment]
            n += 1
    return n


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed copies of ``model``'s :class:`PackedLinear` layers hold (each a copy of its weights)."""
    mods = [m for m in model.modules() if type(m) is PackedLinear]
    own = sum(m.weight.numel() * m.weight.element_size() for m in mods if m.packed)
    fused = sum(sum(w.numel() * w.element_size() for w in (x.weight for x in _FUSED[m][0])) for m in mods if m in _FUSED)
    return own + fused
