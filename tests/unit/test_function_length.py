"""tools/function_length.py: the lint phase's length limit for the package's functions."""

from __future__ import annotations

import textwrap

from tools import function_length
from tools.function_length import long_functions


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}() -> None:\n{body}"


def test_a_function_one_line_over_the_limit_is_named_and_one_at_it_is_not() -> None:
    source = _function("at_limit", 59) + "\n" + _function("over", 60)
    assert [(n, length) for n, _, length in long_functions(source)] == [("over", 61)]


def test_nested_functions_and_methods_count_with_their_qualified_names() -> None:
    source = "def outer() -> None:\n" + _function("inner", 70, "    ") + "\n"
    source += "class C:\n" + _function("method", 70, "    ")
    names = [name for name, _, _ in long_functions(source)]
    assert names == ["outer", "outer.inner", "C.method"]


def test_async_functions_and_decorated_ones_count_too() -> None:
    source = textwrap.dedent("""
        import functools

        @functools.cache
        async def slow() -> None:
    """) + "".join(f"    await x{i}\n" for i in range(61))
    assert [name for name, _, _ in long_functions(source)] == ["slow"]


def test_the_package_has_no_function_over_the_limit(capsys: object) -> None:
    assert function_length.main([]) == 0
