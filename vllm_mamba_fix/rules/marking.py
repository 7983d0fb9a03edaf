"""How every wrapper is finished: it looks like what it wraps (``functools.update_wrapper``,
``__wrapped__`` included) and carries the plugin's marker (``targets.MARKER``) set to what it
carries, which patch, the record and doctor read."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from vllm_mamba_fix.facts.targets import MARKER

Wrapper = TypeVar("Wrapper", bound=Callable[..., Any])


def marked(wrapper: Wrapper, original: Callable[..., Any], marker: Any) -> Wrapper:
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARKER, marker)
    return wrapper
