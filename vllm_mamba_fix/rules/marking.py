"""How every wrapper of the plugin is finished: it looks like what it wraps, and says it is ours.

``marked(wrapper, original, marker)`` copies the original's name, docstring and module
(``functools.update_wrapper``, which also leaves it reachable as ``__wrapped__``) and sets the
plugin's marker (:data:`vllm_mamba_fix.facts.targets.MARKER`) to what the wrapper carries, which
patch, the record and doctor read. Only the plugin's own function objects are touched.
"""

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
