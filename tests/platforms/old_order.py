"""A ``Scheduler`` subclass whose own ``schedule()`` budgets encoder inputs before the split.

Mirrors vllm-ascend's opt-in schedulers with their own copy of ``schedule()``
(vllm_ascend/core/recompute_scheduler.py, scheduler_profiling_chunk.py,
dyntra_lb_scheduler.py, batch_job_aware_scheduler.py,
patch/platform/patch_balance_schedule.py): each calls
``self._try_schedule_encoder_inputs`` before ``self._mamba_block_aligned_split``,
the pre-0.28 order, whatever vLLM runs under it.

No platform code is copied: the subclass's ``schedule()`` is the running
release's own ``Scheduler.schedule``, with one change, made on its syntax tree:
in every block where the split's ``if self.need_mamba_block_aligned_split``
comes before the ``if request.has_encoder_inputs`` budgeting, the split moves
to just after it. The result is written to a real module file, so the plugin
reads its source as it reads any scheduler's.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
from pathlib import Path

SPLIT_FLAG = "need_mamba_block_aligned_split"
ENCODER_FLAG = "has_encoder_inputs"
MODULE_NAME = "vllm_mamba_fix_old_order_scheduler"
CLASS_NAME = "OldOrderScheduler"
NEW_MODULE_NAME = "vllm_mamba_fix_new_order_scheduler"
NEW_CLASS_NAME = "NewOrderScheduler"


def _guarded_by(statement: ast.stmt, attribute: str) -> bool:
    return isinstance(statement, ast.If) and any(
        isinstance(node, ast.Attribute) and node.attr == attribute
        for node in ast.walk(statement.test)
    )


class _SplitAfterEncoder(ast.NodeTransformer):
    """Moves each split after its encoder budgeting; ``reverse``: before it (0.28's order)."""

    def __init__(self, reverse: bool = False) -> None:
        self.moved = 0
        self.reverse = reverse

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            if isinstance(statements, list) and statements:
                self._reorder(statements)
        return node

    def _reorder(self, statements: list[ast.stmt]) -> None:
        if self.reverse:
            self._split_first(statements)
            return
        split = next((i for i, s in enumerate(statements) if _guarded_by(s, SPLIT_FLAG)), None)
        if split is None:
            return
        encoder = next(
            (i for i in range(split + 1, len(statements))
             if _guarded_by(statements[i], ENCODER_FLAG)),
            None,
        )  # fmt: skip
        if encoder is None:
            return
        statements.insert(encoder, statements.pop(split))  # now right after the encoder block
        self.moved += 1

    def _split_first(self, statements: list[ast.stmt]) -> None:
        encoder = next((i for i, s in enumerate(statements) if _guarded_by(s, ENCODER_FLAG)), None)
        if encoder is None:
            return
        split = next(
            (i for i in range(encoder + 1, len(statements))
             if _guarded_by(statements[i], SPLIT_FLAG)),
            None,
        )  # fmt: skip
        if split is None:
            return
        statements.insert(encoder, statements.pop(split))  # now right before the encoder block
        self.moved += 1


def old_order_schedule_source(schedule: object, reverse: bool = False) -> str:
    """``schedule``'s source with each split moved after its encoder budgeting (``reverse``:
    before it, a backport of upstream's #51603 onto a pre-0.28 release).

    Raises if nothing moved: the release already has that order, or its ``schedule()``
    has a shape this transform does not know.
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(schedule))))  # type: ignore[arg-type]
    mover = _SplitAfterEncoder(reverse)
    tree = mover.visit(tree)
    if mover.moved == 0:
        raise ValueError("schedule() has no split before encoder budgeting to move")
    return ast.unparse(ast.fix_missing_locations(tree))


def build_old_order_subclass(directory: Path, reverse: bool = False) -> type:
    """Write and import ``OldOrderScheduler(Scheduler)`` for the vLLM that is importable
    (``reverse``: ``NewOrderScheduler``, the split before encoder budgeting)."""
    from vllm.v1.core.sched import scheduler as release

    schedule = old_order_schedule_source(release.Scheduler.schedule, reverse)
    module_name = NEW_MODULE_NAME if reverse else MODULE_NAME
    class_name = NEW_CLASS_NAME if reverse else CLASS_NAME
    module = (
        "from __future__ import annotations\n\n"
        "from vllm.v1.core.sched import scheduler as _release\n\n"
        "# The names vLLM's own schedule() uses, from its own module.\n"
        "globals().update({k: v for k, v in vars(_release).items() "
        "if not k.startswith('__')})\n\n\n"
        f"class {class_name}(_release.Scheduler):\n"
        '    """vLLM\'s own schedule(), its split and encoder budgeting reordered."""\n\n'
        f"{textwrap.indent(schedule, '    ')}\n"
    )
    (directory / f"{module_name}.py").write_text(module)
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    sys.modules.pop(module_name, None)
    return getattr(importlib.import_module(module_name), class_name)
