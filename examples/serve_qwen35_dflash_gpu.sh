#!/usr/bin/env bash
# A hybrid served with a DFlash drafter on vLLM 0.32+ (GPUs): the two-block-size case (vLLM #54076).
#
# Once the KV cache is built, vLLM's engine core sets cache_config.block_size to the smallest
# block over the prefix-cacheable KV cache groups. DFlash's drafter layers form a group of their
# own with a smaller block, so the scheduler's split floors chunks to the drafter's block while
# the Mamba cache stores a state per larger block: chunks end inside cached blocks and later
# prefix hits can emit wrong tokens. vllm-mamba-fix's block-unit rule aligns every chunk to the
# Mamba cache's block; the engine core logs "block-unit rule engaged ... the Mamba KV cache stores
# N-token blocks but cache_config.block_size is M" once per scheduler.
#
#   pip install vllm-mamba-fix
#   vllm-mamba-fix doctor --speculative-config "$SPEC_CONFIG"   # "the two block sizes will differ"
#   DRAFT_MODEL=<a DFlash drafter for the model> ./examples/serve_qwen35_dflash_gpu.sh
#   VLLM_MAMBA_FIX_BLOCK_RULE=0 ...      # vLLM's own split, for comparison (a warning names the risk)
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen3.5-35B-A3B}"
DRAFT_MODEL="${DRAFT_MODEL:?set DRAFT_MODEL to a DFlash drafter trained for $MODEL}"
TP="${TP:-2}"
SPEC_CONFIG="${SPEC_CONFIG:-{\"method\":\"dflash\",\"model\":\"$DRAFT_MODEL\",\"num_speculative_tokens\":8\}}"

exec vllm serve "$MODEL" \
  --tensor-parallel-size "$TP" \
  --enable-prefix-caching \
  --speculative-config "$SPEC_CONFIG" \
  --max-model-len 32768 \
  --limit-mm-per-prompt '{"image": 2, "video": 0}' \
  --host 0.0.0.0 --port "${PORT:-8000}" \
  "$@"
