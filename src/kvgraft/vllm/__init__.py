"""kvgraft's causal encoder-decoder on vLLM: an out-of-tree model registered through a vLLM plugin.

Install the extra into vLLM's environment (``pip install 'kvgraft[vllm]'``; ``make vllm-env`` does it) and
vLLM finds the plugin by its entry point (group ``vllm.general_plugins``, name ``kvgraft``): every vLLM
process calls :func:`register` before it reads a model, which registers kvgraft's format with
transformers' AutoConfig and the model class with vLLM's ``ModelRegistry``. Then

    vllm serve models/kvgraft-ced-8m --dtype float32 --enforce-eager

serves a kvgraft causal encoder-decoder checkpoint (docs/vllm.md). ``import kvgraft`` never imports this
package, and this module imports neither vLLM nor torch: only :func:`register` does, when vLLM calls it.
``register`` also gives adapters that provably change no cached row the base's prefix-cache key
(``kvgraft.vllm.lora.install_hash_keys``).
"""

from __future__ import annotations

ARCHITECTURE = "KvgraftForCausalLM"  # config.json's "architectures" entry of kvgraft's own format
MODEL_CLASS = "kvgraft.vllm.model:KvgraftCEDForCausalLM"
EXTRA_HINT = "kvgraft's vLLM model needs vLLM: pip install 'kvgraft[vllm]' (make vllm-env builds that environment)"


def register() -> None:
    """vLLM's plugin hook: register kvgraft's config with transformers and the CED model with vLLM.

    Safe to call more than once (vLLM loads plugins in every process, possibly repeatedly)."""
    # deliberately lazy: vLLM and transformers are heavy and only needed once vLLM calls the hook
    try:
        from vllm import ModelRegistry
    except ImportError as exc:  # pragma: no cover - vLLM calls this hook, so vLLM is present
        raise ImportError(EXTRA_HINT) from exc
    import kvgraft.hf  # noqa: F401  (registers model_type "kvgraft" with transformers' AutoConfig)
    from kvgraft.vllm.lora import install_hash_keys

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    install_hash_keys()  # KV-neutral kvgraft adapters share the base's prefix cache (kvgraft.vllm.lora)


__all__ = ["ARCHITECTURE", "MODEL_CLASS", "register"]
