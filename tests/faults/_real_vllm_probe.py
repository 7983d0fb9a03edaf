"""One real-vLLM process for the checks that need a fresh interpreter (run by the tests).

Run with ``VLLM_PLUGINS=some_other_plugin``. Phases, each reported as a
``RESULT <name> <json>`` line on stdout (vLLM's log lines go there too):

1. ``child``: an engine-core-like child started with multiprocessing ``spawn``
   and ``VLLM_PLUGINS=mamba_fix``; it runs ``load_general_plugins()`` and
   imports the scheduler, as ``EngineCore.__init__`` does.
2. ``excluded``: here, ``load_general_plugins()`` under allow-lists that exclude
   the plugin, then the scheduler import: the plugin is never even imported.
3. ``hygiene``: with an audit hook and a recording ``os.environ``, ``register()``
   and corrections through vLLM's real method on real ``Request`` objects whose
   prompt carries sentinels.

Keep module-level imports light: the spawn child imports this file again.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
METHOD = "_mamba_block_aligned_split"
MARKER = "__vllm_mamba_fix__"
SENTINEL_TEXT = "SENTINEL-salt-9c1e"
SENTINEL_TOKEN = 48151623
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
WATCHED_EVENTS = (
    "socket.",
    "os.mkdir",
    "os.rename",
    "os.remove",
    "os.rmdir",
    "os.truncate",
    "os.symlink",
    "os.link",
    "os.chmod",
    "shutil.",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.fork",
    "os.posix_spawn",
    "os.putenv",
    "os.unsetenv",
)


def result(name: str, payload: dict[str, Any]) -> None:
    print(f"RESULT {name} {json.dumps(payload, sort_keys=True)}", flush=True)


def is_patched() -> bool:
    scheduler = sys.modules[SCHEDULER_MODULE].Scheduler
    return hasattr(scheduler.__dict__[METHOD], MARKER)


def engine_core_child() -> None:
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    import vllm.v1.core.sched.scheduler

    # A real scheduler, built as EngineCore builds one: its class's active line.
    from tools.sched_harness import HarnessConfig, build_scheduler

    build_scheduler(HarnessConfig())
    result(
        "child",
        {"pid": os.getpid(), "patched": is_patched(), "allow": os.environ.get("VLLM_PLUGINS")},
    )


class RecordingEnviron(dict):  # type: ignore[type-arg]
    """Enough of ``os.environ`` to record what is read."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        self.read: list[str] = []

    def __getitem__(self, key: str) -> str:
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.append(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.append(str(key))
        return super().__contains__(key)

    def __iter__(self) -> Any:
        self.read.append("<whole environment>")
        return super().__iter__()


def make_request(request_id: str, num_computed_tokens: int) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feature = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=f"img-{SENTINEL_TEXT}",
        mm_position=PlaceholderRange(offset=100, length=256),
        mm_hash=f"hash-{SENTINEL_TEXT}",
    )
    request = Request(
        request_id=request_id,
        prompt_token_ids=[SENTINEL_TOKEN] * 600,
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        mm_features=[feature],
        cache_salt=f"salt-{SENTINEL_TEXT}",
    )
    request.num_computed_tokens = num_computed_tokens
    return request


def hygiene() -> None:
    from types import SimpleNamespace

    scheduler = sys.modules[SCHEDULER_MODULE].Scheduler

    # What vLLM 0.27.1's method reads from the scheduler, at the engine's block size.
    class MambaSpec(SimpleNamespace):
        pass

    class FakeScheduler(SimpleNamespace):
        """A stand-in held weakly, as a real scheduler is (the installation's record)."""

    group = SimpleNamespace(kv_cache_spec=MambaSpec(block_size=128))
    fake_self = FakeScheduler(
        cache_config=SimpleNamespace(block_size=128),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[group]),
        use_eagle=False,
        max_num_scheduled_tokens=192,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        hash_block_size=128,
        mamba_partial_cache_hit=False,
        # An encoder cache smaller than the image: the cut at it never clears.
        encoder_cache_manager=SimpleNamespace(
            cache_size=64, num_free_slots=64, get_cached_input_ids=lambda request: set()
        ),
        max_num_encoder_input_tokens=64,
    )
    requests = [make_request("req-hyg-1", 0), make_request("req-hyg-2", 100)]
    stock = [scheduler.__dict__[METHOD](fake_self, requests[0], 100)]
    events: list[list[str]] = []
    reads: list[str] = []  # shows the hook sees opens at all (importing the plugin reads)
    recording = True

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if not recording:
            return
        if event == "open":
            path, mode, flags = (*args, None, None, None)[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS
            )
            if writes:
                events.append([event, repr(path), repr(mode), repr(flags)])
            else:
                reads.append(repr(path))
        elif event.startswith(WATCHED_EVENTS):
            events.append([event, repr(args)[:200]])

    real_environ = os.environ
    recorder = RecordingEnviron(real_environ)
    sys.addaudithook(audit)
    os.environ = recorder  # type: ignore[assignment]  # noqa: B003 - record reads only
    try:
        import vllm_mamba_fix

        vllm_mamba_fix.register()
        patched = is_patched()
        method = scheduler.__dict__[METHOD]
        # What the plugin's wrapper of vLLM's encoder check notes before this split: it was
        # asked for the step's 192 tokens and cut them at the image (token 100).
        from vllm_mamba_fix.rules import encoder_cut

        encoder_cut.note(fake_self, requests[0], 0, 192, 100)
        corrected = [method(fake_self, requests[0], 100), method(fake_self, requests[1], 200)]
        del requests[1].__dict__["shared_prefix_boundary"]  # vLLM's own method then raises
        try:
            method(fake_self, requests[1], 200)
            vllm_error = None
        except AttributeError as exc:
            vllm_error = type(exc).__name__
        counts = vllm_mamba_fix.stats()  # unregister() forgets them
        vllm_mamba_fix.unregister()
    finally:
        os.environ = real_environ  # type: ignore[assignment]  # noqa: B003
        recording = False
    result(
        "hygiene",
        {
            "patched": patched,
            "stock": stock,
            "corrected": corrected,
            "vllm_error": vllm_error,
            "events": events,
            "plugin_files_read": sum("vllm_mamba_fix" in path for path in reads),
            "env_read": sorted(set(recorder.read)),
            "counters": counts,
        },
    )


def main() -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    os.environ["VLLM_PLUGINS"] = "mamba_fix"  # the child's environment
    child = context.Process(target=engine_core_child)
    child.start()
    os.environ["VLLM_PLUGINS"] = excluded = os.environ["PROBE_EXCLUDE"]

    import vllm.plugins

    seen = []
    for allow in (excluded, "", " mamba_fix", "mamba-fix"):
        os.environ["VLLM_PLUGINS"] = allow
        vllm.plugins.plugins_loaded = False
        vllm.plugins.load_general_plugins()
        seen.append("vllm_mamba_fix" in sys.modules)
    import vllm.v1.core.sched.scheduler

    result(
        "excluded",
        {
            "plugin_imported": seen,
            "patched": is_patched(),
            "pid": os.getpid(),
            "hooks": [type(f).__name__ for f in sys.meta_path],
        },
    )
    print("PHASE hygiene", flush=True)
    hygiene()
    child.join(300)
    result("parent", {"child_exitcode": child.exitcode})


if __name__ == "__main__":
    main()
