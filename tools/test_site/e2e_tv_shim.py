"""Let vLLM's Qwen3-VL/Qwen3.5 code run on a ``+cpu`` torch that has no torchvision.

TEST-ONLY: applied by ``tools/test_site/sitecustomize.py`` when the tests, the demo or the CPU
examples put ``tools/test_site`` on ``PYTHONPATH``; never part of the installed plugin. It does
nothing when torchvision can be imported (a normal GPU install).

Two gaps, both closed with transformers' own code (nothing re-implemented):

1. ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` imports torchvision at module level,
   and vLLM's ``qwen3_vl.py`` imports ``smart_resize`` from it, so Qwen3.5 cannot even be
   imported. transformers ships a PIL twin, ``image_processing_pil_qwen2_vl`` (identical
   ``smart_resize``; ``Qwen2VLImageProcessorPil``, which transformers itself already substitutes
   for ``Qwen2VLImageProcessor`` without torchvision). The torchvision module name is served by
   a module populated from the PIL twin.
2. Without torchvision, ``Qwen3VLVideoProcessor`` (and ``VideoProcessorMixin``) on the package
   namespaces are placeholders that raise, so ``Qwen3VLProcessor.from_pretrained`` fails. The
   real classes import torchvision lazily and construct fine; we bind them to those names.
   Decoding a video would still need torchvision: everything here runs with ``"video": 0``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

from e2e_post_import import when_imported

TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
QWEN3_VL_PKG = "transformers.models.qwen3_vl"
VIDEO_MODULE = "transformers.models.qwen3_vl.video_processing_qwen3_vl"


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


class _PilAliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # default module creation

    def exec_module(self, module: ModuleType) -> None:
        pil = importlib.import_module(PIL_MODULE)
        for key, value in vars(pil).items():
            if not key.startswith("__"):
                setattr(module, key, value)
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        module.__doc__ = f"{PIL_MODULE} served as {TV_MODULE} (no torchvision; test shim)"


class _PilAliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == TV_MODULE:
            return importlib.util.spec_from_loader(name, _PilAliasLoader())
        return None


def _expose_video_processor(package: ModuleType) -> None:
    real = importlib.import_module(VIDEO_MODULE).Qwen3VLVideoProcessor
    # vLLM: ``from transformers.models.qwen3_vl import Qwen3VLVideoProcessor`` (isinstance).
    setattr(package, "Qwen3VLVideoProcessor", real)  # noqa: B010
    # AutoVideoProcessor and ProcessorMixin resolve names on the top-level package.
    top = importlib.import_module("transformers")
    setattr(top, "Qwen3VLVideoProcessor", real)  # noqa: B010
    utils = importlib.import_module("transformers.video_processing_utils")
    for name in ("VideoProcessorMixin", "BaseVideoProcessor"):
        setattr(top, name, getattr(utils, name))


_installed = False


def install() -> bool:
    """Install once per process. Returns whether the shim is active."""
    global _installed
    if _installed:
        return True
    if not torchvision_missing():
        return False
    sys.meta_path.insert(0, _PilAliasFinder())
    when_imported(QWEN3_VL_PKG, _expose_video_processor)
    _installed = True
    return True
