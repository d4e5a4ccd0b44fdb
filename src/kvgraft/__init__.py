"""kvgraft: change where a transformer's KV cache lives (MLA graft, cross-layer sharing, placement-aware LoRA).

``import kvgraft`` is light: it imports neither torch nor transformers. The subpackages import what they
need (``kvgraft.model``: torch; ``kvgraft.hf``: transformers). ``import kvgraft.hf`` registers kvgraft's
own format (model_type "kvgraft") with transformers' AutoConfig/AutoModelForCausalLM.
"""

__version__ = "0.1.0"
