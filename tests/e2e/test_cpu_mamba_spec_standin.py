"""The test-only CPU stand-ins for vLLM's speculative Mamba-align Triton kernels copy exactly what
vLLM's own scalar path copies (no engine; seconds).

``tools/test_site/e2e_cpu_mamba_spec.py`` lets the speculative e2e test run on the CPU engine. The
engine run proves the scheduler side, but its random MTP head never gets a draft accepted, so the
stand-ins' accepted-token branches (a non-zero token bias) never run there. Here they run against
vLLM 0.27.1's reference for the same copy: ``collect_mamba_copy_meta`` (the per-request path that
``preprocess_mamba`` takes without a speculative context) over ``get_conv_copy_spec`` /
``get_temporal_copy_spec``, executed by the CPU build's own ``batch_memcpy`` fallback. The state
metadata comes from vLLM's real ``MambaSpecDecodeGPUContext.initialize_from_forward_context``.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from tools.tiny_model import SHIM_DIR

pytestmark = pytest.mark.e2e

BLOCK = 4  # tokens per block (only the postprocess decision reads it)
NUM_BLOCKS = 12
CONV_WIDTH, CONV_DIM = 5, 6  # conv state: width (kernel - 1 + speculative tokens) x dim
HEADS, HEAD_DIM = 2, 3  # temporal state per block: HEADS x HEAD_DIM x HEAD_DIM
# Two requests with scrambled physical blocks, so a wrong row or column shows.
BLOCK_IDS = [[7, 2, 9, 4, 11, 0], [3, 10, 5, 1, 8, 6]]


@pytest.fixture()
def vllm_parts(monkeypatch: pytest.MonkeyPatch):
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(SHIM_DIR))
    import e2e_cpu_mamba_spec as standin
    from vllm.model_executor.layers.mamba import mamba_utils as layer_utils
    from vllm.utils import cpu_triton_utils
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker import mamba_utils

    for name in standin.KERNELS:  # restored after the test: the stand-ins are test-only
        monkeypatch.setattr(mamba_utils, name, getattr(mamba_utils, name))
    standin._bind(mamba_utils)
    for name in standin.KERNELS:
        assert getattr(mamba_utils, name).cpu_stand_in, "Triton is available: nothing to test"
    return SimpleNamespace(
        torch=torch,
        mu=mamba_utils,
        layer_utils=layer_utils,
        memcpy=cpu_triton_utils._batch_memcpy_impl,
        buffer=lambda *size, dtype: CpuGpuBuffer(
            *size, dtype=dtype, device=torch.device("cpu"), pin_memory=False
        ),
        stats=standin.STATS,
    )


def _states(v, seed: int):
    torch = v.torch
    gen = torch.Generator().manual_seed(seed)
    if v.layer_utils.is_conv_state_dim_first():
        conv = torch.randn(NUM_BLOCKS, CONV_DIM, CONV_WIDTH, generator=gen)
    else:
        conv = torch.randn(NUM_BLOCKS, CONV_WIDTH, CONV_DIM, generator=gen)
    temporal = torch.randn(NUM_BLOCKS, HEADS, HEAD_DIM, HEAD_DIM, generator=gen)
    return [conv, temporal]


def _context(v, states, block_table):
    torch, mu = v.torch, v.mu
    copy_funcs = (v.layer_utils.get_conv_copy_spec, v.layer_utils.get_temporal_copy_spec)
    n = len(states)

    def zeros(dtype):
        return torch.zeros(n, dtype=dtype)

    ctx = mu.MambaSpecDecodeGPUContext(
        state_base_addrs=zeros(torch.int64),
        state_block_strides=zeros(torch.int64),
        state_elem_sizes=zeros(torch.int32),
        state_inner_sizes=zeros(torch.int64),
        state_conv_widths=zeros(torch.int32),
        state_group_indices=zeros(torch.int32),
        state_dim_row_count=zeros(torch.int32),
        state_dim_row_stride=zeros(torch.int64),
        block_size=BLOCK,
        num_layers=1,
        num_state_types=n,
        mamba_group_ids=[0],
        num_groups=1,
        num_accepted_tokens_out=torch.zeros(len(BLOCK_IDS), dtype=torch.int32),
        block_table_ptrs=torch.zeros(1, dtype=torch.int64),
    )
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["gdn"])])
    forward_context = {"gdn": SimpleNamespace(kv_cache=states)}
    ctx.initialize_from_forward_context(kv_cache_config, forward_context, copy_funcs, [block_table])
    return ctx, kv_cache_config, forward_context, copy_funcs


def _scalar_copy(v, states, copies):
    """vLLM's per-request path: ``collect_mamba_copy_meta`` + the CPU ``batch_memcpy``."""
    torch, mu = v.torch, v.mu
    table = _table(v)  # unused by this path, but the context holds its address
    _ctx, kv_cache_config, forward_context, copy_funcs = _context(v, states, table)
    bufs = mu.MambaCopyBuffers(
        src_ptrs=v.buffer(16, dtype=torch.uint64),
        dst_ptrs=v.buffer(16, dtype=torch.uint64),
        sizes=v.buffer(16, dtype=torch.int32),
        mamba_group_ids=[0],
        mamba_spec=None,
    )
    for req, (src, dst, bias) in enumerate(copies):
        if src is None:
            continue
        req_state = SimpleNamespace(block_ids=[BLOCK_IDS[req]])
        mu.collect_mamba_copy_meta(
            bufs, kv_cache_config, copy_funcs, [0], src, dst, bias, req_state, forward_context
        )
    n = bufs.offset
    v.memcpy(bufs.src_ptrs.cpu[:n], bufs.dst_ptrs.cpu[:n], bufs.sizes.cpu[:n])


def _table(v):
    torch = v.torch
    table = torch.full((len(BLOCK_IDS), 8), -1, dtype=torch.int32)
    for row, ids in enumerate(BLOCK_IDS):
        table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return table


def _conv_bias_supported(v, bias: int) -> bool:
    # vLLM's scalar conv spec refuses a bias in the DS layout (only the fused kernel has one).
    return bias == 0 or not v.layer_utils.is_conv_state_dim_first()


@pytest.mark.parametrize("bias", [0, 1, 2])
def test_precopy_matches_vllm_scalar_path(vllm_parts, bias: int) -> None:
    v = vllm_parts
    if not _conv_bias_supported(v, bias):
        pytest.skip("vLLM's scalar path has no DS-layout conv copy with a token bias")
    torch = v.torch
    # Request 0 crosses from column 1 to 3 with ``bias`` accepted drafts; request 1 stays put.
    copies = [(1, 3, bias), (None, None, 0)]
    expected = _states(v, seed=bias)
    _scalar_copy(v, expected, copies)

    got = _states(v, seed=bias)
    table = _table(v)
    ctx, *_ = _context(v, got, table)
    state_idx = torch.tensor([3, 2], dtype=torch.int32)
    src_col = torch.tensor([1, -1], dtype=torch.int32)
    token_bias = torch.tensor([bias, 0], dtype=torch.int32)
    ctx.run_fused_precopy(2, state_idx, src_col, token_bias, idx_mapping=None)

    for name, a, b in zip(("conv", "temporal"), got, expected, strict=True):
        assert torch.equal(a, b), f"{name} state differs from vLLM's scalar path"
    assert v.stats["precopy_mamba_align_fused_kernel"]["copies"] >= 1


@pytest.mark.parametrize(
    ("computed", "accepted", "src_block", "want"),
    [
        # 2 drafts, both accepted: 5 + 1 + 2 = 8 tokens, a boundary; the running state is at
        # position 6, so the state after 8 is 2 tokens further (bias 2), kept in column 1.
        (5, 3, 1, (1, 1, 2)),
        # Only the bonus token: 7 + 1 = 8, exactly the running position: no bias; the running
        # column 1 is the target column, so nothing to copy but the count resets to 1.
        (7, 1, 1, None),
        # Both drafts accepted again, running in column 2: 9 + 1 + 2 = 12, kept in column 2.
        (9, 3, 2, (2, 2, 2)),
        # One draft accepted: 8 + 1 + 1 = 10, mid-block: no aligned state to keep.
        (8, 2, 2, None),
    ],
)
def test_postprocess_matches_vllm_scalar_path(
    vllm_parts, computed: int, accepted: int, src_block: int, want
) -> None:
    v = vllm_parts
    torch = v.torch
    if want is not None and not _conv_bias_supported(v, want[2]):
        pytest.skip("vLLM's scalar path has no DS-layout conv copy with a token bias")
    expected = _states(v, seed=10 + computed)
    _scalar_copy(v, expected, [want or (None, None, 0), (None, None, 0)])

    got = _states(v, seed=10 + computed)
    table = _table(v)  # the context holds its address: keep it alive
    ctx, *_ = _context(v, got, table)

    def t(*values):
        return torch.tensor(values, dtype=torch.int32)

    ctx.run_fused_postprocess(
        num_reqs=2,
        num_accepted_tokens_gpu=t(accepted, 1),
        mamba_state_idx_gpu=t(src_block, 0),
        num_scheduled_tokens_gpu=t(3, 1),  # 1 + 2 drafts; request 1 decodes without drafts
        num_computed_tokens_gpu=t(computed, 2),
        num_draft_tokens_gpu=t(2, 0),
    )
    for name, a, b in zip(("conv", "temporal"), got, expected, strict=True):
        assert torch.equal(a, b), f"{name} state differs from vLLM's scalar path"
    # The accepted count resets to 1 when the kept state sits in the running column.
    lands_in_running = (computed + 3 - 2 + accepted - 1) // BLOCK - 1 == src_block
    aligned = (computed + 3 - 2 + accepted - 1) // BLOCK * BLOCK >= computed + 1
    assert int(ctx.num_accepted_tokens_out[0]) == (1 if aligned and lands_in_running else accepted)


def test_bound_only_without_triton(vllm_parts) -> None:
    """The stand-ins replace a kernel only where ``kernel[grid]`` cannot work (no Triton)."""
    import e2e_cpu_mamba_spec as standin

    sentinel = type("Kernel", (), {"__getitem__": lambda self, grid: None})()
    module = SimpleNamespace(**dict.fromkeys(standin.KERNELS, sentinel))
    standin._bind(module)
    assert all(getattr(module, name) is sentinel for name in standin.KERNELS)
    assert sys.modules["e2e_cpu_mamba_spec"] is standin
