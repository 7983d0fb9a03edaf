"""Let videos run through vLLM 0.27.1's Qwen3-VL path on a ``+cpu`` torch without torchvision.

TEST-ONLY: applied by ``tools/test_site/sitecustomize.py`` (tests, demo and CPU examples put
``tools/test_site`` on ``PYTHONPATH``); never part of the installed plugin. It does nothing when
torchvision can be imported (a normal GPU install), where neither gap exists.

Two gaps, both outside the plugin and the scheduler:

1. transformers' video processors are torchvision-only: ``BaseVideoProcessor.convert_to_rgb``
   calls ``tvF.grayscale_to_rgb``, and the torchvision backend resizes and normalizes with
   ``tvF.resize`` / ``tvF.normalize``. The PyPI torchvision does not load beside a ``+cpu`` torch
   (``operator torchvision::nms does not exist``), so ``tvF`` is unbound (``NameError``). We bind a
   stand-in with exactly the functions that path calls, written with torch ops; any other name
   raises, naming itself. Outputs may differ from torchvision's in the last bit of a resize;
   the tests pick frame sizes the processor keeps (no resampling) and compare the engine with
   itself anyway.
2. vLLM 0.27.1's ``Qwen3VLMultiModalProcessor._call_hf_processor`` processes each video alone,
   then calls the HF processor on the whole prompt text without the videos, and splices the
   video tokens in afterwards. transformers 5.x validates placeholder counts and rejects that
   (``Found 1 <|video_pad|> tokens in the text but no videos were passed``). When no videos are
   passed we validate the text without its video tokens; they are tokenized unchanged (one token
   each), which is what vLLM's splice expects. With videos passed, nothing changes.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from e2e_post_import import when_imported

# Test switch: which parts to install, comma-separated ("tvf", "text"; default both), so a test
# can show each gap open without its part.
PARTS_ENV = "VLLM_E2E_VIDEO_SHIM_PARTS"

# Modules that use the module-level name ``tvF`` on the video path.
TVF_USERS = (
    "transformers.video_processing_utils",
    "transformers.image_processing_backends",
    "transformers.models.qwen3_vl.video_processing_qwen3_vl",
)
IMAGE_UTILS = "transformers.image_utils"
QWEN3_VL_PROCESSING = "transformers.models.qwen3_vl.processing_qwen3_vl"


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode's members and values."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _flat(image: Any) -> tuple[Any, tuple[int, ...]]:
    """(N, C, H, W) view of a (..., C, H, W) tensor, and the leading shape."""
    lead = tuple(image.shape[:-3])
    return image.reshape(-1, *image.shape[-3:]), lead


def grayscale_to_rgb(image: Any) -> Any:
    if image.shape[-3] != 1:
        return image
    return image.expand(*image.shape[:-3], 3, *image.shape[-2:]).clone()


def resize(
    image: Any,
    size: Sequence[int],
    interpolation: InterpolationMode = InterpolationMode.BILINEAR,
    antialias: bool = True,
) -> Any:
    import torch
    import torch.nn.functional as F

    height, width = int(size[0]), int(size[1])
    if tuple(image.shape[-2:]) == (height, width):
        return image  # torchvision's v2 resize returns the input unchanged too
    modes = {
        InterpolationMode.BILINEAR: "bilinear",
        InterpolationMode.BICUBIC: "bicubic",
        InterpolationMode.NEAREST: "nearest",
        InterpolationMode.NEAREST_EXACT: "nearest-exact",
    }
    if interpolation not in modes:
        raise NotImplementedError(f"test-only tvF stand-in: no {interpolation} resize")
    mode = modes[interpolation]
    flat, lead = _flat(image)
    dtype = flat.dtype
    out = F.interpolate(
        flat.to(torch.float32),
        size=(height, width),
        mode=mode,
        antialias=antialias and mode in ("bilinear", "bicubic"),
        **({"align_corners": False} if mode in ("bilinear", "bicubic") else {}),
    )
    if dtype == torch.uint8:
        out = out.round().clamp(0, 255)
    return out.to(dtype).reshape(*lead, *out.shape[-3:])


def normalize(image: Any, mean: Any, std: Any, inplace: bool = False) -> Any:
    import torch

    mean_t = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
    out = image if inplace else image.clone()
    return out.sub_(mean_t).div_(std_t)


def to_dtype(image: Any, dtype: Any, scale: bool = False) -> Any:
    import torch

    if not scale or image.dtype == dtype:
        return image.to(dtype)
    if image.dtype == torch.uint8 and dtype.is_floating_point:
        return image.to(dtype) / 255.0
    if image.dtype.is_floating_point and dtype == torch.uint8:
        return (image * 255.0).round().clamp(0, 255).to(dtype)
    raise NotImplementedError(f"test-only tvF stand-in: to_dtype {image.dtype} -> {dtype}")


class _TvfStandIn(ModuleType):
    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"test-only tvF stand-in (tools/test_site/e2e_video_shim.py) has no {name!r}"
        )


def _tvf() -> ModuleType:
    module = _TvfStandIn("torchvision_transforms_v2_functional_standin")
    module.__doc__ = "torch-only stand-in for the tvF functions transformers' video path calls"
    for value in (InterpolationMode, grayscale_to_rgb, resize, normalize, to_dtype):
        setattr(module, value.__name__, value)
    return module


TVF = _tvf()


def _bind_tvf(module: ModuleType) -> None:
    if "tvF" not in vars(module):
        module.tvF = TVF
    # image_processing_backends sets these names to None without torchvision.
    for name in ("pil_torch_interpolation_mapping", "torch_pil_interpolation_mapping"):
        if name in vars(module) and vars(module)[name] is None:
            image_utils = importlib.import_module(IMAGE_UTILS)
            _fill_interpolation_maps(image_utils)
            setattr(module, name, getattr(image_utils, name))


def _fill_interpolation_maps(image_utils: ModuleType) -> None:
    """transformers.image_utils leaves these empty without torchvision; the torchvision
    backend's resize looks PIL resample codes up in them. Filled in place: importers hold
    the same dict objects."""
    pil = image_utils.PILImageResampling
    forward = image_utils.pil_torch_interpolation_mapping
    if forward:
        return
    forward.update(
        {
            pil.NEAREST: InterpolationMode.NEAREST_EXACT,
            pil.BOX: InterpolationMode.BOX,
            pil.BILINEAR: InterpolationMode.BILINEAR,
            pil.HAMMING: InterpolationMode.HAMMING,
            pil.BICUBIC: InterpolationMode.BICUBIC,
            pil.LANCZOS: InterpolationMode.LANCZOS,
        }
    )
    image_utils.torch_pil_interpolation_mapping.update({v: k for k, v in forward.items()})


def _allow_text_without_videos(processing: ModuleType) -> None:
    cls = processing.Qwen3VLProcessor
    original = cls.validate_inputs
    if getattr(original, "_video_shim", False):
        return

    def validate_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        text, videos = kwargs.get("text"), kwargs.get("videos")
        token = getattr(self, "video_token", None)
        if videos is None and token and text is not None:
            samples = [text] if isinstance(text, str) else list(text)
            if any(token in sample for sample in samples):
                kwargs["text"] = [sample.replace(token, "") for sample in samples]
        return original(self, *args, **kwargs)

    validate_inputs._video_shim = True  # type: ignore[attr-defined]
    cls.validate_inputs = validate_inputs


_installed = False


def install() -> bool:
    """Install once per process. Returns whether the shim is active."""
    global _installed
    if _installed:
        return True
    if not torchvision_missing():
        return False
    parts = {p.strip() for p in os.environ.get(PARTS_ENV, "tvf,text").split(",")}
    if "tvf" in parts:
        for name in TVF_USERS:
            when_imported(name, _bind_tvf)
        when_imported(IMAGE_UTILS, _fill_interpolation_maps)
    if "text" in parts:
        when_imported(QWEN3_VL_PROCESSING, _allow_text_without_videos)
    _installed = True
    return True
