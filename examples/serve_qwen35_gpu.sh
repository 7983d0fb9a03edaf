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
#
# This is the command line the bug was reported on: TP2, prefix caching and MTP speculative
# decoding with 2 draft tokens. On GPUs vLLM also turns async scheduling on by default, so the
# engine core runs AsyncScheduler with use_eagle set (MTP is an EAGLE-type method); the plugin
# covers that scheduler too (it inherits the patched method). SPEC_CONFIG= (empty) serves without
# speculative decoding.
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen3.5-35B-A3B}"
TP="${TP:-2}"   # align-mode block (without MTP): 1056 tokens at TP1/TP2, 528 at TP4; MTP can change it
REPORTED_SPEC='{"method":"qwen3_next_mtp","num_speculative_tokens":2}'
SPEC_CONFIG="${SPEC_CONFIG-$REPORTED_SPEC}"

spec_args=()
if [[ -n "$SPEC_CONFIG" ]]; then
  spec_args=(--speculative-config "$SPEC_CONFIG")
fi

exec vllm serve "$MODEL" \
  --tensor-parallel-size "$TP" \
  --enable-prefix-caching \
  "${spec_args[@]}" \
  --mamba-cache-mode align \
  --max-model-len 32768 \
  --limit-mm-per-prompt '{"image": 2, "video": 0}' \
  --host 0.0.0.0 --port "${PORT:-8000}" \
  "$@"
