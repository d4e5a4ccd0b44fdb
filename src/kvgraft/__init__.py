"""kvgraft: change where a transformer's KV cache lives (MLA graft, cross-layer sharing, placement-aware LoRA)."""

__version__ = "0.1.0"
