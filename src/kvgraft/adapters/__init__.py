"""Placement-aware LoRA: placement by meaning, the sharing certificate, PEFT-format adapters, optimizer groups."""
