"""CPU stand-ins for the two Triton kernels of vLLM's speculative Mamba "align" path (TEST-ONLY).

Applied by ``tools/test_site/sitecustomize.py`` in processes that have ``tools/test_site`` on
``PYTHONPATH`` (the tests, the demo, the CPU examples); never part of the installed plugin.

Why: with speculative decoding (MTP/EAGLE) on a hybrid model in ``mamba_cache_mode="align"``,
vLLM 0.27.1's model runner builds a ``MambaSpecDecodeGPUContext`` and moves Mamba states between
block columns with two Triton kernels in ``vllm/v1/worker/mamba_utils.py``:
``precopy_mamba_align_fused_kernel`` (before the forward pass) and
``postprocess_mamba_fused_kernel`` (after the rejection sampler). The CPU build replaces other
Triton kernels of that module and of speculative decoding (``cpu_model_runner._postprocess_triton``
binds ``vllm.utils.cpu_triton_utils`` versions, e.g. ``batch_memcpy_kernel``), but not these two.
Without Triton, ``@triton.jit`` leaves plain functions, and the first step dies with::

    File ".../vllm/v1/worker/mamba_utils.py", line 826, in run_fused_precopy
      precopy_mamba_align_fused_kernel[grid](
    TypeError: 'function' object is not subscriptable

What: ports of both kernels (and their shared ``_copy_mamba_state_block``) to Python, in the form
vLLM's own CPU fallbacks take (an object whose ``[grid]`` returns the implementation). They run
the same decisions over the same metadata the context already holds (state base addresses, block
strides, conv widths, block-table addresses) and copy the same bytes with ``ctypes.memmove``, one
program ``(request, state)`` at a time. They are bound only where the module's kernel is not
subscriptable, i.e. where Triton is unavailable; with a working Triton nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import sys
from types import ModuleType
from typing import Any

from e2e_post_import import when_imported

MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
KERNELS = ("precopy_mamba_align_fused_kernel", "postprocess_mamba_fused_kernel")
TAG = "test_site: CPU stand-in"
# Per kernel: launches, and state blocks copied (with a non-zero accepted-token bias).
STATS: dict[str, dict[str, int]] = {}


class _Grid:
    """``kernel[grid](...)`` with the grid passed to the implementation."""

    def __init__(self, name: str, impl) -> None:
        self.name, self.impl = name, impl
        self.cpu_stand_in = True
        STATS[name] = {"launches": 0, "copies": 0, "biased_copies": 0}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            stats = STATS[self.name]
            stats["launches"] += 1
            copies = self.impl(tuple(grid), *args, **kwargs)
            stats["copies"] += copies[0]
            stats["biased_copies"] += copies[1]
            if stats["launches"] == 1 or (copies[0] and stats["copies"] == copies[0]):
                # First launch, and first launch that copied: evidence in the worker's log.
                print(f"{TAG} {self.name} ran: {stats}", file=sys.stderr, flush=True)

        return launch


def _as_list(t: Any) -> list[int]:
    return [int(v) for v in t.tolist()]


class _Layout:
    """The state-layout metadata of one launch, read once."""

    def __init__(
        self,
        block_table_ptrs,
        block_table_stride_req,
        base_addrs,
        block_strides,
        elem_sizes,
        inner_sizes,
        conv_widths,
        group_indices,
        dim_row_count,
        dim_row_stride,
        conv_state_dim_first,
    ) -> None:
        self.bt_ptrs = _as_list(block_table_ptrs)
        self.bt_stride = int(block_table_stride_req)
        self.base = _as_list(base_addrs)
        self.block_stride = _as_list(block_strides)
        self.elem = _as_list(elem_sizes)
        self.inner = _as_list(inner_sizes)
        self.conv = _as_list(conv_widths)
        self.group = _as_list(group_indices)
        self.rows = _as_list(dim_row_count)
        self.row_stride = _as_list(dim_row_stride)
        self.dim_first = bool(conv_state_dim_first)

    def _block_id(self, state: int, row: int, col: int) -> int:
        # Block tables are int32 [max_reqs, max_blocks]; one per Mamba group.
        addr = self.bt_ptrs[self.group[state]] + (row * self.bt_stride + col) * 4
        return ctypes.c_int32.from_address(addr).value

    def copy(self, state: int, row: int, src_col: int, dst_col: int, bias: int) -> None:
        """``_copy_mamba_state_block`` of mamba_utils.py, byte for byte."""
        base, stride, elem = self.base[state], self.block_stride[state], self.elem[state]
        conv_width = self.conv[state]
        dst = base + self._block_id(state, row, dst_col) * stride
        if conv_width > 0 and self.dim_first:
            # DS conv layout: slide each dim row by ``bias`` tokens.
            src = base + self._block_id(state, row, src_col) * stride
            size = (conv_width - bias) * elem
            for d in range(self.rows[state]):
                off = d * self.row_stride[state]
                ctypes.memmove(dst + off, src + off + bias * elem, size)
            return
        if conv_width > 0:
            # SD conv: state[bt[src], bias:] -> state[bt[dst], :conv_width - bias]
            inner = self.inner[state]
            src = base + self._block_id(state, row, src_col) * stride + bias * inner * elem
            ctypes.memmove(dst, src, (conv_width - bias) * inner * elem)
            return
        # Temporal state: state[bt[src + bias]] -> state[bt[dst]], natural size (not the stride).
        src = base + self._block_id(state, row, src_col + bias) * stride
        ctypes.memmove(dst, src, self.inner[state] * elem)


def _precopy(
    grid: tuple[int, ...],
    mamba_state_idx,
    src_col_t,
    token_bias_t,
    block_table_ptrs,
    block_table_stride_req,
    base_addrs,
    block_strides,
    elem_sizes,
    inner_sizes,
    conv_widths,
    group_indices,
    dim_row_count,
    dim_row_stride,
    idx_mapping,
    num_reqs,
    COPY_BLOCK_SIZE=1024,  # the kernel's keyword names
    CONV_STATE_DIM_FIRST=False,
    HAS_IDX_MAPPING=True,
    TEMPORAL_TILES=1,  # 0.32+: tiles split one copy across programs; here one program copies all
    *,
    rows_by_req: bool = False,
) -> list[int]:
    """``precopy_mamba_align_fused_kernel``: previous running column -> new column.

    ``rows_by_req``: the block-table row is the request's state slot (0.32+), not the batch row.
    """
    layout = _Layout(
        block_table_ptrs,
        block_table_stride_req,
        base_addrs,
        block_strides,
        elem_sizes,
        inner_sizes,
        conv_widths,
        group_indices,
        dim_row_count,
        dim_row_stride,
        CONV_STATE_DIM_FIRST,
    )
    dst_cols, src_cols, biases = map(_as_list, (mamba_state_idx, src_col_t, token_bias_t))
    mapping = _as_list(idx_mapping) if HAS_IDX_MAPPING else None
    copies = [0, 0]
    for batch_idx in range(min(grid[0], int(num_reqs))):
        req_idx = mapping[batch_idx] if mapping is not None else batch_idx
        if req_idx < 0:
            continue
        src_col, dst_col = src_cols[req_idx], dst_cols[req_idx]
        if src_col < 0 or src_col == dst_col:
            continue
        row = req_idx if rows_by_req else batch_idx
        for state in range(grid[1]):
            layout.copy(state, row, src_col, dst_col, biases[req_idx])
        copies[0] += 1
        copies[1] += biases[req_idx] != 0
    return copies


def _postprocess(
    grid: tuple[int, ...],
    num_accepted_t,
    mamba_state_idx,
    num_scheduled_t,
    num_computed_t,
    num_draft_t,
    block_table_ptrs,
    block_table_stride_req,
    base_addrs,
    block_strides,
    elem_sizes,
    inner_sizes,
    conv_widths,
    group_indices,
    dim_row_count,
    dim_row_stride,
    num_accepted_out,
    idx_mapping,
    num_reqs,
    block_size,
    COPY_BLOCK_SIZE=1024,  # the kernel's keyword names
    CONV_STATE_DIM_FIRST=False,
    HAS_IDX_MAPPING=False,
    PRECOMPUTED_NEW_COMPUTED=False,
    TEMPORAL_TILES=1,
    *,
    rows_by_req: bool = False,
) -> list[int]:
    """``postprocess_mamba_fused_kernel``: keep the block-aligned state after acceptance.

    ``rows_by_req`` (0.32+): block-table row and the accepted-count store both by state slot.
    """
    layout = _Layout(
        block_table_ptrs,
        block_table_stride_req,
        base_addrs,
        block_strides,
        elem_sizes,
        inner_sizes,
        conv_widths,
        group_indices,
        dim_row_count,
        dim_row_stride,
        CONV_STATE_DIM_FIRST,
    )
    accepted = _as_list(num_accepted_t)  # read before any write, as the parallel kernel does
    src_blocks = _as_list(mamba_state_idx)
    computed = _as_list(num_computed_t)
    if not PRECOMPUTED_NEW_COMPUTED:
        scheduled, drafts = _as_list(num_scheduled_t), _as_list(num_draft_t)
    mapping = _as_list(idx_mapping) if HAS_IDX_MAPPING else None
    copies = [0, 0]
    for batch_idx in range(min(grid[0], int(num_reqs))):
        req_idx = mapping[batch_idx] if mapping is not None else batch_idx
        if req_idx < 0:
            continue
        num_accepted, src_block = accepted[req_idx], src_blocks[req_idx]
        if PRECOMPUTED_NEW_COMPUTED:
            new_computed = computed[req_idx]
            running = new_computed - num_accepted + 1
        else:
            running = computed[req_idx] + scheduled[req_idx] - drafts[req_idx]
            new_computed = running + num_accepted - 1
        aligned = new_computed // block_size * block_size
        if aligned < running:
            continue
        bias = aligned - running
        dst_block = aligned // block_size - 1
        if src_block == dst_block:
            target = num_accepted_t if HAS_IDX_MAPPING and not rows_by_req else num_accepted_out
            target[req_idx] = 1
            if bias == 0:
                continue
        bt_row = batch_idx if HAS_IDX_MAPPING and not rows_by_req else req_idx
        for state in range(grid[1]):
            layout.copy(state, bt_row, src_block, dst_block, bias)
        copies[0] += 1
        copies[1] += bias != 0
    return copies


def _bind(module: ModuleType) -> None:
    impls = {KERNELS[0]: _precopy, KERNELS[1]: _postprocess}
    for name, impl in impls.items():
        kernel = getattr(module, name, None)
        if kernel is not None and not hasattr(kernel, "__getitem__"):
            # The kernel's own parameters say which release's indexing it has: 0.32 added
            # TEMPORAL_TILES with the rows-by-state-slot indexing.
            rows_by_req = "TEMPORAL_TILES" in inspect.signature(kernel).parameters
            setattr(module, name, _Grid(name, functools.partial(impl, rows_by_req=rows_by_req)))


def install() -> bool:
    when_imported(MAMBA_UTILS, _bind)
    return True
