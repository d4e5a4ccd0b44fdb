"""kvgraft's linear layers on vLLM's CPU GEMM, as vLLM's own models run theirs.

vLLM's CPU backend runs every linear layer of its models through ``dispatch_cpu_unquantized_gemm``
(``vllm.model_executor.layers.utils``): the weight packed once for oneDNN (``onednn_mm``, or sgl-kernel's
packed GEMM for small shapes), called as a custom op that torch.compile keeps opaque. The plugin's model is
kvgraft's ``Transformer`` with plain ``nn.Linear`` layers, which ran through ``aten::mm`` (the weight laid out
again on every call). :func:`use_vllm_cpu_gemm` gives each of them vLLM's dispatch: the module becomes a
:class:`VllmCpuLinear` (an ``nn.Linear``: same parameters, names and state dict; the weight is kept, since
kvgraft reads some weights directly, e.g. ``kv_b`` for the absorbed stream read and adapters merging into it).
The packed copy is made from the weight at that moment: call it after the weights are loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class VllmCpuLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is vLLM's CPU GEMM on a packed copy of its weight (``cpu_linear``)."""

    cpu_linear: Any
    same_function_as_linear = True  # kvgraft's adapters wrap it as a plain nn.Linear (only the kernel differs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.cpu_linear(x, self.weight, self.bias)
        return out


def use_vllm_cpu_gemm(model: nn.Module) -> int:
    """Route every plain ``nn.Linear`` of ``model`` through vLLM's CPU GEMM; returns how many. Layers that
    already run on it are packed again from their current weights (weights loaded a second time are never
    served stale). Nothing on other platforms (their linear layers stay ``nn.Linear``)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    n = 0
    for module in model.modules():
        if type(module) in (nn.Linear, VllmCpuLinear):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            module.__class__ = VllmCpuLinear
            n += 1
    return n
