"""The plugin's series at ``/metrics``: names, help texts, and the labels vLLM's own carry.

Every series carries vLLM's ``model_name`` and ``engine`` labels with vLLM's values, so joins
with ``vllm:num_requests_running`` work (``data_parallel_index``: vLLM resets the rank to 0 for a
non-MoE model). Gauges are ``mostrecent``, as vLLM's: an unwiped directory does not add up."""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm_mamba_fix._version import __version__

Labels = tuple[tuple[str, str], ...]


class Series(NamedTuple):
    metric: str  # without "_total", as prometheus_client keys a counter
    help: str
    labels: Labels = ()
    kind: str = "counter"  # or "gauge"

    @property
    def sample(self) -> str:
        return self.metric + "_total" if self.kind == "counter" else self.metric


def _correction(rule: str, action: str) -> Series:
    help_text = (
        "Scheduler chunks vllm-mamba-fix corrected, by rule and action (engine core, summed)"
    )
    return Series("vllm_mamba_fix_corrections", help_text, (("action", action), ("rule", rule)))


# Per stats() key (counters.KEYS), its counter.
SERIES: dict[str, Series] = {
    "collapses_prevented": _correction("split", "collapse-prevented"),
    # Also the block-unit rule's boundary stop: one action, one series.
    "chunks_realigned": _correction("split", "realigned"),
    "chunks_stopped_at_encoder_input": _correction("split", "stopped-at-encoder-input"),
    "speculative_stalls_released": _correction("speculative-stall", "released"),
    "encoder_references_dropped": _correction("split", "encoder-references-dropped"),
    "block_rule_chunks": Series(
        "vllm_mamba_fix_block_rule_chunks",
        "Chunks the block-unit rule ended at the Mamba cache's block (vLLM #54076)",
    ),
    "stalls_detected": Series(
        "vllm_mamba_fix_stalls_named", "Stalled prefills the stall watchdog named"
    ),
    "stalls_resolved": Series(
        "vllm_mamba_fix_stalls_moved_again", "Named stalls whose request moved again"
    ),
    "stalls_ended": Series(
        "vllm_mamba_fix_stalls_ended", "Named stalls the plugin ended, finishing the request"
    ),
}

INFO = Series(
    "vllm_mamba_fix_info",
    "vllm-mamba-fix in this engine core: versions, the rules that run, settings (always 1)",
    kind="gauge",
)
SPLIT_BLOCK = Series(
    "vllm_mamba_fix_split_block_size",
    "The block vLLM's split aligns chunks to (cache_config.block_size), in tokens",
    kind="gauge",
)
MAMBA_BLOCK = Series(
    "vllm_mamba_fix_mamba_block_size",
    "The Mamba KV cache's block in tokens (0: unreadable); not the split's block: vLLM #54076",
    kind="gauge",
)
STALLED = Series(
    "vllm_mamba_fix_stalled_requests",
    "Requests the stall watchdog named that have not moved again or ended yet",
    kind="gauge",
)
OLDEST_STALL = Series(
    "vllm_mamba_fix_oldest_stall_start_time_seconds",
    "Unix time the oldest stall standing now began (its first 0-token step); 0 when none",
    kind="gauge",
)
GAUGES = (INFO, SPLIT_BLOCK, MAMBA_BLOCK, STALLED, OLDEST_STALL)

METRIC_NAMES = frozenset(s.sample for s in (*SERIES.values(), *GAUGES))

IDENTITY = ("model_name", "engine")


def identity(vllm_config: Any) -> Labels:
    """``(("engine", index), ("model_name", name))`` as vLLM labels this engine core's series."""
    model = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None)
    if isinstance(model, (list, tuple)):  # ModelConfig keeps the first; a bare config may not
        model = model[0] if model else None
    parallel = getattr(vllm_config, "parallel_config", None)
    index = getattr(parallel, "data_parallel_index", None)
    if not isinstance(index, int):  # a release or config without it: the rank
        index = getattr(parallel, "data_parallel_rank", 0)
    return (("engine", str(int(index or 0))), ("model_name", "" if model is None else str(model)))


def with_labels(series: Series, extra: Labels) -> Labels:  # sorted: one key per label set
    return tuple(sorted({**dict(series.labels), **dict(extra)}.items()))


def info_labels(found: Any, settings: Any, vllm_version: str) -> dict[str, str]:
    """The info series' own labels (``found``: the class's ClassRecord, None if unrecorded)."""

    def seconds(value: float | None) -> str:
        return "off" if value is None else f"{value:g}"

    rules = sorted(rule.value for rule in found.rules) if found is not None else []
    return {
        "version": __version__,
        "vllm_version": vllm_version,
        "rules": ",".join(rules) or "none",
        "scope": settings.scope.value,
        "scheduler": found.scheduler_class if found is not None else "",
        "stall_seconds": seconds(settings.stall_seconds),
        "end_stalls_after": seconds(settings.end_stalls_after),
    }
