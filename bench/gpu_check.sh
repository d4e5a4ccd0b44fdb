#!/usr/bin/env bash
# The prepared accelerator check (one H200, a few minutes): absorbed MLA decode vs GQA at long
# contexts on a 1B-shape model, in bf16, side by side in one process. Prints the table; results JSON
# goes to ${OUT:-runs/bench}/gpu_decode. Needs a CUDA build of torch on that machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
PYTHONPATH=src python bench/mla_decode.py --random-1b --device cuda --dtype bfloat16 \
  --contexts 1024 8192 32768 --batch-sizes 1 16 --new-tokens 32 --repeats 3 --compression 4 \
  --out "${OUT:-runs/bench}/gpu_decode"
# vLLM on the GPU: a random stock DeepSeek-V3 (no kvgraft code) and kvgraft's engine-safe 512 + 64 export,
# greedy tokens and top-5 logprobs against transformers (docs/vllm.md); needs vLLM installed there
if python -c "import vllm" 2>/dev/null; then
  PYTHONPATH=src python bench/gpu_check_vllm_parity.py
  # kvgraft's causal encoder-decoder through the kvgraft.vllm plugin: tokens vs kvgraft's engine, KV bytes
  PYTHONPATH=src python bench/gpu_check_vllm_ced.py
else
  echo "vllm is not installed on this machine: skipping bench/gpu_check_vllm_parity.py and bench/gpu_check_vllm_ced.py"
fi
# Conversion at scale (issue 26): an 8B-shape random bf16 checkpoint (16 GB, written tensor by tensor)
# converted to MLA on the GPU, time per layer and peak memory (host and GPU)
PYTHONPATH=src python bench/gpu_convert.py --shape llama-8b --device cuda --work "${OUT:-runs/bench}/gpu_convert"
# The real model (issue 34): SmolLM2-135M-Instruct converted on the GPU at 4x, kvgraft format and the default stock
# export, with and without local refinement, scored on the held-out texts (bench/real_oneshot.py). The device
# machine reaches no network and takes at most 64 MiB of carried files, so the model (269 MB) and the texts must
# already be there (`make real-model`, `python bench/real_texts.py`); otherwise this says so and skips.
MODEL_DIR="${KVGRAFT_CACHE_DIR:-.cache}/models/smollm2-135m-instruct"
if [ -f "$MODEL_DIR/config.json" ] && [ -f runs/real-texts/manual.npy ]; then
  PYTHONPATH=src python bench/real_oneshot.py --settings 4:kvgraft:0 4:kvgraft:8 4:deepseek_v3:8 \
    --out "${OUT:-runs/bench}/gpu_real_oneshot" --convert-args --device cuda
else
  echo "$MODEL_DIR or runs/real-texts missing on this machine: skipping bench/real_oneshot.py"
fi
