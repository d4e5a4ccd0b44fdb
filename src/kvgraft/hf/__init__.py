"""transformers interop: load Llama/Mistral/Qwen2/Qwen3 checkpoints into kvgraft and save them back.

Importing this package registers kvgraft's own format (model_type "kvgraft") with transformers'
AutoConfig and AutoModelForCausalLM (:func:`register_auto_classes`), so after ``import kvgraft.hf``
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` loads a kvgraft checkpoint as a
``KvgraftForCausalLM``. (``import kvgraft`` alone does not: it stays free of torch and transformers.)
"""

from kvgraft.hf.auto import KvgraftConfig, KvgraftForCausalLM, register_auto_classes
from kvgraft.hf.config_map import SUPPORTED_MODEL_TYPES, hf_config_from_model, model_config_from_hf
from kvgraft.hf.deepseek import export_deepseek_v3
from kvgraft.hf.load import load_config, load_pretrained, load_tokenizer_dir
from kvgraft.hf.save import save_pretrained

register_auto_classes()

__all__ = [
    "KvgraftConfig",
    "KvgraftForCausalLM",
    "SUPPORTED_MODEL_TYPES",
    "export_deepseek_v3",
    "hf_config_from_model",
    "load_config",
    "load_pretrained",
    "load_tokenizer_dir",
    "model_config_from_hf",
    "register_auto_classes",
    "save_pretrained",
]
