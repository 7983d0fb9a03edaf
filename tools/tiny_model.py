"""Build a tiny random-weight Qwen3.5-style hybrid vision-language model for CPU tests.

The model is ``Qwen3_5ForConditionalGeneration`` built from transformers' own classes:

* text: hidden 64, 3 GatedDeltaNet (``linear_attention``) layers + 1 full-attention layer,
  linear head dim 64 (the CPU GDN kernel rejects 32);
* vision: a 1-layer tower, patch 16, merge 2, so a 512x512 image is exactly 256 tokens;
* a byte-level tokenizer (256 bytes + Qwen's special tokens) with a Qwen-style chat template;
* a hand-written ``preprocessor_config.json``.

Nothing is downloaded. Weights are random but scaled up (see ``_sharpen``) so that greedy output
depends on the whole context, in particular on the image pixels: the "outputs unchanged" tests
could otherwise pass trivially.

The torchvision gap
-------------------
vLLM's ``qwen3_vl.py`` (imported by ``qwen3_5.py``) imports
``transformers.models.qwen2_vl.image_processing_qwen2_vl``, which imports torchvision at module
level. With a ``+cpu`` torch the PyPI torchvision wheels do not load, so the Qwen3.5 model class
cannot even be imported. transformers ships a torchvision-free twin of that module,
``image_processing_pil_qwen2_vl`` (same ``smart_resize``, ``Qwen2VLImageProcessorPil``), and already
falls back to it by itself for ``Qwen2VLImageProcessor``. ``Qwen3VLProcessor`` additionally wants
a video processor, whose class refuses to run without torchvision.

The route taken: ``tools/test_site/`` is a directory that tests, the demo and the CPU examples
(never the installed plugin) put on ``PYTHONPATH`` (see :func:`shim_env`). It holds
``sitecustomize.py``, which Python imports at start-up in *every* process that inherits the
environment: the test process, vLLM's engine-core subprocess, the ``vllm serve`` API server and
its engine core. A model-dir-local fix cannot work: the failing import happens when vLLM imports
its own Qwen3.5 model module, before any model-dir code could run. A vLLM general plugin would
also reach every process, but would need installing (an entry point), which is exactly what a
test-only fix must not do. The shim serves the torchvision module name from transformers' own
PIL twin (``image_processing_pil_qwen2_vl``) and binds the real, lazily-torchvision
``Qwen3VLVideoProcessor`` where transformers left a raising placeholder (images only:
everything runs with ``limit_mm_per_prompt={"video": 0}``). It does nothing when torchvision
imports, so on a normal GPU install it is inert. See ``tools/test_site/e2e_tv_shim.py``.

With ``--mtp-layers 1`` (``build(..., mtp_layers=1)``) the checkpoint also carries a Qwen3.5-style
multi-token-prediction head (``mtp_num_hidden_layers`` and ``mtp.*`` weights), from which vLLM
builds its ``Qwen3_5MTP`` drafter for ``speculative_config={"method": "mtp", ...}``. The main
model's weights do not change. Its drafts are random and almost all rejected.

With ``--tracking-mtp`` (``build(..., mtp_layers=1, tracking=True)``) drafts get accepted most of
the time while the target's greedy tokens still depend on the Mamba state (issue 36; see
:func:`_track_bigram`): each lowercase letter's embedding leans towards the LM-head row of a
successor letter (a 26-cycle), so the target's next token is that successor unless the context
(the GatedDeltaNet states, the attention layer) outweighs it, and the MTP head is wired to
compute exactly the successor: ``fc`` passes the normalised embedding of the last token through
and ignores the target's hidden state, and its decoder layer adds nothing (``o_proj`` and
``down_proj`` zero). The main weights differ from the plain model's (the letter embeddings).

Usage::

    python -m tools.tiny_model /tmp/tiny-qwen35                     # prints the directory
    python -m tools.tiny_model /tmp/tiny-qwen35-mtp --mtp-layers 1  # with an MTP head
    python -m tools.tiny_model /tmp/tiny-qwen35-track --mtp-layers 1 --tracking-mtp
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# Qwen's special tokens, in Qwen3.5's order. Ids are 256.. (after the 256 byte tokens).
SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
VOCAB_SIZE = 320  # 256 bytes + 14 specials, padded up (vLLM pads the LM head anyway)
IMAGE_SIZE = 512  # 512x512 -> (512/16/2)^2 = 256 tokens
TOKENS_PER_IMAGE = 256
SHIM_DIR = Path(__file__).resolve().parent / "test_site"
BUILD_VERSION = "4"  # bump when the recipe changes, so cached dirs get rebuilt (4: videos)
# Seed 1: in float32 the greedy path of the two-image demo request keeps a top-1 margin of >= 3%
# of the largest logit over 16 tokens (seeds 0-7 checked), so bf16 differences between
# chunkings do not flip it, and a different second image changes the output.
DEFAULT_SEED = 1
# --tracking-mtp: how far a letter's embedding leans towards its successor's LM-head row, in
# units of the embedding's own scale (norm 8 = sqrt(hidden)). At 1.75 the float32 target follows
# the successor on ~78% of greedy steps of varied prompts, and prompts that differ in one word
# still decode differently (measured with transformers; 1.0: 41%, 3.0: 100% and context-blind).
TRACK_LEAN = 1.75
TRACK_STEP = 7  # successor of letter i is letter (7 i + 3) mod 26: one 26-cycle, no fixed point

# Qwen3-VL style template, reduced to what the tests need: text, image and video parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or item['type'] == 'image_url' or 'image' in item -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item['type'] == 'video' or item['type'] == 'video_url' or 'video' in item -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def special_id(token: str) -> int:
    return 256 + SPECIAL_TOKENS.index(token)


def shim_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Return ``env`` (default: os.environ) with the torchvision shim prepended to PYTHONPATH."""
    out = dict(os.environ if env is None else env)
    parts = [str(SHIM_DIR), str(SHIM_DIR.parent.parent)]
    if out.get("PYTHONPATH"):
        parts.append(out["PYTHONPATH"])
    out["PYTHONPATH"] = os.pathsep.join(parts)
    return out


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # Byte-level vocabulary without merges: every byte is one token.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_unicode = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_to_unicode)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(special_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _byte_of(ch: str) -> int:
    # Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip([chr(c) for c in cs], bs, strict=True))[ch]


def _write_processor_configs(out: Path) -> None:
    # Hand-written: loading Qwen's processor from a hub is exactly what we avoid. The image and
    # video processors share Qwen3-VL's normalisation and patch geometry; they differ only in
    # their type, the pixel cap and the video sampling keys.
    pixels = IMAGE_SIZE * IMAGE_SIZE
    shared = {
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    min_pixels = 32 * 32 * 4
    image_cfg = {
        "image_processor_type": "Qwen2VLImageProcessor",
        **shared,
        "size": {"shortest_edge": min_pixels, "longest_edge": pixels},
    }
    video_cfg = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        **shared,
        "size": {"shortest_edge": min_pixels, "longest_edge": pixels * 2},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 8,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(image_cfg, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_cfg, indent=2))


def _config(mtp_layers: int = 0):  # -> transformers.Qwen3_5Config
    from transformers import Qwen3_5Config

    text = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,  # the CPU GDN kernel rejects 32
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 3, 3],  # sums to rotary_dim/2 = 64*0.25/2
            "mrope_interleaved": True,
        },
        "eos_token_id": special_id("<|im_end|>"),
        "pad_token_id": special_id("<|endoftext|>"),
        "dtype": "float32",
    }
    if mtp_layers:
        # vLLM derives its MTP draft model (``Qwen3_5MTP``) from this key of the text config.
        text["mtp_num_hidden_layers"] = mtp_layers
    vision = {
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 1,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 1024,  # 32x32 grid = 512x512 pixels
        "hidden_act": "gelu_pytorch_tanh",
    }
    return Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=special_id("<|image_pad|>"),
        video_token_id=special_id("<|video_pad|>"),
        vision_start_token_id=special_id("<|vision_start|>"),
        vision_end_token_id=special_id("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def _sharpen(model, seed: int) -> None:  # model: torch.nn.Module
    """Re-draw weights with larger variance so outputs depend strongly on the context.

    With the default init (std 0.02) and hidden 64, logits are nearly constant and greedy
    decoding emits one token regardless of the input. Unit-scale embeddings and
    1/sqrt(fan_in)-scaled projections keep activations O(1) through 4 layers.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue  # norms, biases, dt_bias: keep transformers' init (A_log: below)
            fan_in = p[0].numel()
            std = 1.0 if "embed_tokens" in name else 1.5 / fan_in**0.5
            if "lm_head" in name:
                std = 4.0 / fan_in**0.5  # peaky logits: ties are unlikely
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        # Only lowercase letters get non-zero LM-head rows: readable output, never a special
        # token, and fewer competitors, so top-1 margins are wide enough that bf16 rounding
        # differences between chunkings cannot flip a greedy choice.
        head = model.get_output_embeddings().weight
        keep = torch.zeros(head.shape[0], dtype=torch.bool)
        keep[ord("a") : ord("z") + 1] = True
        head[~keep] = 0.0
        # GatedDeltaNet decay: transformers draws A in (0.01, 16), i.e. the recurrent state forgets
        # within a token or two. Slow decay (A in (0.002, 0.02)) keeps the images in the state.
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                a = torch.empty(module.A_log.shape).uniform_(0.002, 0.02, generator=gen)
                module.A_log.copy_(a.log())


def successor(letter: int) -> int:
    """The token a ``--tracking-mtp`` model's MTP head drafts after lowercase ``letter``."""
    i = letter - ord("a")
    return ord("a") + (TRACK_STEP * i + 3) % 26


def _track_bigram(model) -> None:  # model: torch.nn.Module
    """Lean each lowercase letter's embedding towards its successor's LM-head row.

    The residual stream of the last position starts from the token's embedding, so the target
    favours ``successor(token)``; the GatedDeltaNet and attention layers add a context-dependent
    part that overrides it where its margin is small. That share is what the drafter gets wrong.
    """
    import torch

    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        scale = embed.shape[1] ** 0.5
        for letter in range(ord("a"), ord("z") + 1):
            row = head[successor(letter)]
            embed[letter] += TRACK_LEAN * scale * row / row.norm()


def _write_mtp_weights(out: Path, layers: int, seed: int, tracking: bool = False) -> None:
    """Add Qwen3.5-style multi-token-prediction weights (``mtp.*``) to the saved checkpoint.

    transformers' Qwen3.5 has no MTP module (it ignores ``mtp.*`` on load), so the names are
    those of vLLM's ``Qwen3_5MTP`` loader: ``fc`` over [embedding; hidden], three norms and
    ``layers`` that are full-attention decoder layers shaped like the model's own (copied from
    its full-attention layer's shapes, drawn afresh). The draft shares ``lm_head`` and the
    embedding. Random drafts are mostly rejected, which is fine: greedy speculative decoding
    emits the target model's tokens whatever the drafter proposes.

    ``tracking``: ``fc`` is ``[I, 0]`` (the normalised embedding of the token, not the target's
    hidden state) and the layers' output projections are zero, so the head's logits are the LM
    head over the normalised embedding: the successor (:func:`_track_bigram`).
    """
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed + 1000)
    prefix = "model.language_model.layers.3."  # the full-attention layer
    hidden = tensors["model.language_model.norm.weight"].shape[0]
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5}
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        mtp[f"mtp.{name}.weight"] = torch.zeros(hidden)  # Gemma-style RMSNorm: scale 1 + w
    for i in range(layers):
        for name, ref in tensors.items():
            if not name.startswith(prefix):
                continue
            if ref.dim() < 2:
                new = torch.zeros_like(ref)
            else:
                new = torch.randn(ref.shape, generator=gen) * (1.5 / ref[0].numel() ** 0.5)
            if tracking and name.endswith(("o_proj.weight", "down_proj.weight")):
                new = torch.zeros_like(ref)
            mtp[f"mtp.layers.{i}.{name[len(prefix) :]}"] = new.to(ref.dtype)
    if tracking:
        fc = torch.zeros(hidden, 2 * hidden)
        fc[:, :hidden] = torch.eye(hidden)
        mtp["mtp.fc.weight"] = fc
    save_file({**tensors, **mtp}, str(path), metadata={"format": "pt"})


def build(
    out_dir: str | os.PathLike[str],
    seed: int = DEFAULT_SEED,
    force: bool = False,
    mtp_layers: int = 0,
    tracking: bool = False,
) -> Path:
    """Build (or reuse) the tiny model in ``out_dir`` and return its path.

    ``mtp_layers > 0`` adds a Qwen3.5-style MTP head (``mtp_num_hidden_layers`` in the text
    config and ``mtp.*`` weights), for ``speculative_config={"method": "mtp", ...}``. The main
    model's weights are the same as without it, unless ``tracking`` (module docstring).
    """
    if tracking and not mtp_layers:
        raise ValueError("tracking needs an MTP head (mtp_layers > 0)")
    out = Path(out_dir)
    stamp = out / ".tiny_model_build"
    recipe = f"{BUILD_VERSION}:{seed}" + (f":mtp{mtp_layers}" if mtp_layers else "")
    recipe += f":track{TRACK_LEAN}" if tracking else ""
    if not force and stamp.exists() and stamp.read_text() == recipe:
        return out
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = _config(mtp_layers)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    _sharpen(model, seed)
    if tracking:
        _track_bigram(model)
    model.save_pretrained(out, safe_serialization=True)
    if mtp_layers:
        _write_mtp_weights(out, mtp_layers, seed, tracking)
    # vLLM reads generation defaults from here; keep it greedy-neutral and stop on <|im_end|>.
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": special_id("<|im_end|>"), "do_sample": False}, indent=2)
    )
    _write_tokenizer(out)
    _write_processor_configs(out)
    stamp.write_text(recipe)
    return out


def demo_images(seed: int = 0, n: int = 3) -> list:  # -> list[PIL.Image.Image]
    """``n`` different, deterministic 512x512 RGB images.

    Each is a distinct pattern (noise, gradient, stripes, ...) rather than noise of one
    distribution: 256 tokens of i.i.d. noise average out to nearly the same context, so two
    noise images barely change what a random model says.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) / IMAGE_SIZE
    patterns = [
        lambda: rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3)),  # noise
        lambda: np.stack([x, y, 1 - x], -1) * 255,  # colour gradient
        lambda: np.stack([(np.sin(40 * x) > 0) * 255.0, y * 80, 0 * x + 30], -1),  # stripes
        lambda: np.stack([0 * x + 250, 0 * x + 200, 0 * x + 20], -1),  # flat yellow
    ]
    out = []
    for i in range(n):
        arr = patterns[i % len(patterns)]()
        out.append(Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)))
    return out


def image_prompt(num_images: int, text: str | None = None) -> str:
    """Raw prompt: ``num_images`` placeholders back to back, then ``text``.

    Image ``k`` (from 0) sits at ``[1 + 258k, 257 + 258k)``: each placeholder is
    ``<|vision_start|>``, 256 pads, ``<|vision_end|>``. So the first 256 tokens of every prompt
    that starts with the same image are the same (one prefix-cache block at block size 256).
    """
    if text is None:
        text = {1: "Describe the image.", 2: "Describe both images."}.get(
            num_images, "Describe the images."
        )
    return "<|vision_start|><|image_pad|><|vision_end|>" * num_images + text


def two_image_prompt(text: str = "Describe both images.") -> str:
    """Raw prompt with image 1 at [1,257) and image 2 at [259,515)."""
    return image_prompt(2, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="/tmp/vllm-mamba-fix-tiny-qwen35")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    parser.add_argument(
        "--mtp-layers", type=int, default=0, help="add an MTP head of this many layers"
    )
    parser.add_argument(
        "--tracking-mtp", action="store_true", help="an MTP head whose drafts are mostly accepted"
    )
    args = parser.parse_args(argv)
    model_dir = build(
        args.out_dir,
        seed=args.seed,
        force=args.force,
        mtp_layers=args.mtp_layers,
        tracking=args.tracking_mtp,
    )
    print(model_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
