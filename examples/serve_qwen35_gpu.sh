#!/usr/bin/env bash
# The production reproduction: Qwen3.5-35B-A3B (hybrid GatedDeltaNet/attention MoE VL model)
# served by vLLM 0.15.0-0.27.1 on GPUs with prefix caching, which puts the Mamba cache in
# "align" mode. A request carrying two large images can stall forever at a block boundary
# (`/health` stays 200). With `pip install vllm-mamba-fix` in the same environment, vLLM loads
# the plugin in every process and the engine core's scheduler is patched; nothing else changes.
#
#   pip install vllm-mamba-fix            # on every node that runs vLLM
#   ./examples/serve_qwen35_gpu.sh        # then: python examples/openai_two_images_stream.py \
#                                         #   --model Qwen/Qwen3.5-35B-A3B --image-size 1536
#   VLLM_MAMBA_FIX=0 ./examples/serve_qwen35_gpu.sh   # stock behaviour, for comparison
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen3.5-35B-A3B}"
TP="${TP:-2}"   # align-mode block is 1056 tokens at TP1/TP2, 528 at TP4

exec vllm serve "$MODEL" \
  --tensor-parallel-size "$TP" \
  --enable-prefix-caching \
  --mamba-cache-mode align \
  --max-model-len 32768 \
  --limit-mm-per-prompt '{"image": 2, "video": 0}' \
  --host 0.0.0.0 --port "${PORT:-8000}" \
  "$@"
