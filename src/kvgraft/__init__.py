"""kvgraft: change where a transformer's KV cache lives (MLA graft, cross-layer sharing, placement-aware LoRA)."""

__version__ = "0.1.0"


def _register_with_transformers() -> None:
    """Let transformers' AutoConfig/AutoModelForCausalLM load kvgraft's own format (model_type "kvgraft")."""
    try:
        from kvgraft.hf.auto import register_auto_classes

        register_auto_classes()
    except Exception as exc:  # kvgraft itself works without the registration: warn, do not fail the import
        import warnings

        warnings.warn(f"kvgraft: could not register with transformers' Auto classes: {exc!r}", stacklevel=2)


_register_with_transformers()
