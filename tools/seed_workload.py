"""The seed's multi-turn workload, driven in the engine-demo worker (issue 36).

A phase with ``conversations`` (``tools.engine_demo.Phase``) runs this instead of its requests:

* every conversation's turn ``k`` is sent at once (the conversations decode side by side, so a
  small KV pool preempts); turn ``k + 1`` extends turn ``k``'s prompt by its output text (none
  for an aborted turn), a user message with the turn's new images and text, and the assistant
  header, so each turn hits the prefix cache at the block boundaries of the previous one;
* a turn with ``abort_after`` is aborted that many engine steps after it was sent (mid-prefill
  for a small number), and the next turn extends its prompt: it hits the blocks the aborted
  prefill cached;
* then the oracle: every turn that came back, computed cold (prefix cache reset before each) in
  the same engine, one at a time;
* then the first and the last turn of the first conversation three times more: cold again
  (``prime``), warm (a hit on what that cached), and warm after every cached Mamba state was
  zeroed (``broken``, :func:`zero_mamba_states`): the tokens depend on the cached state.

Each turn prints one ``DEMO-RESULT`` line: its prompt, images, tokens, hit, whether it was
aborted, and vLLM's speculative-decoding and preemption counters over the step loop it ran in;
a last ``totals`` line has the phase's counters and the CPU kernel stand-ins' copy counts.
"""

from __future__ import annotations

from typing import Any

from tools.tiny_model import image_prompt

TURN_START = "<|im_start|>user\n"
TURN_END = "<|im_end|>\n<|im_start|>assistant\n"
REPLY_END = "<|im_end|>\n"


def extend(prompt: str, reply: str, images: int, text: str) -> str:
    """The next turn's prompt: the previous prompt and reply, then a user message."""
    head = prompt + reply + REPLY_END if prompt else ""
    return head + TURN_START + image_prompt(images, text) + TURN_END


def _send(engine: Any, params: Any, jobs: list[dict[str, Any]], counts) -> list[dict[str, Any]]:
    """Add ``jobs`` at once and step until each finished or was aborted; return the outputs."""
    before = counts()
    done: dict[str, Any] = {}
    for job in jobs:
        engine.add_request(job["id"], job["prompt"], params)
    steps = 0
    aborted: set[str] = set()
    while len(done) + len(aborted) < len(jobs):
        for output in engine.step():
            if output.finished and output.request_id not in aborted:
                done[output.request_id] = output
        steps += 1
        for job in jobs:
            if job.get("abort_after") == steps and job["id"] not in done:
                engine.abort_request([job["id"]])
                aborted.add(job["id"])
    after = counts()
    delta = {k: after[k] - before[k] for k in after} if before and after else None
    return [
        {**job, "output": done.get(job["id"]), "aborted": job["id"] in aborted, "counts": delta}
        for job in jobs
    ]


def _result(phase: str, job: dict[str, Any], kind: str) -> dict[str, Any]:
    out = job["output"]
    completion = out.outputs[0] if out is not None else None
    return {
        "phase": phase,
        "kind": kind,
        "conversation": job["conversation"],
        "turn": job["turn"],
        "request_id": job["id"],
        "images": job["images"],
        "prompt_text": job["prompt"]["prompt"],
        "aborted": job["aborted"],
        "token_ids": list(completion.token_ids) if completion is not None else [],
        "text": completion.text if completion is not None else "",
        "prompt_tokens": len(out.prompt_token_ids or []) if out is not None else 0,
        "num_cached_tokens": out.num_cached_tokens if out is not None else 0,
        "counts": job["counts"],
    }


def run(llm: Any, phase: dict[str, Any], images: list[Any], params: Any, emit, counts) -> None:
    """Run ``phase["conversations"]`` on ``llm`` (see the module docstring); ``emit`` prints
    one result, ``counts`` reads vLLM's counters (``tools.engine_demo.spec_counts``)."""
    engine = llm.llm_engine
    name = phase["name"]
    convs = phase["conversations"]
    state = [{"prompt": "", "reply": "", "images": []} for _ in convs]
    served: list[dict[str, Any]] = []
    for turn in range(max(len(c) for c in convs)):
        jobs = []
        for c, conv in enumerate(convs):
            if turn >= len(conv):
                continue
            spec, st = conv[turn], state[c]
            text = extend(st["prompt"], st["reply"], len(spec.get("images", [])), spec["text"])
            ids = st["images"] + spec.get("images", [])
            prompt: dict[str, Any] = {"prompt": text}
            if ids:
                prompt["multi_modal_data"] = {"image": [images[i] for i in ids]}
            job = {"id": f"{name}-c{c}-t{turn}", "conversation": c, "turn": turn, "images": ids}
            jobs.append({**job, "prompt": prompt, "abort_after": spec.get("abort_after")})
        for job in _send(engine, params, jobs, counts):
            result = _result(name, job, "turn")
            emit(result)
            st = state[job["conversation"]]
            st.update(prompt=result["prompt_text"], images=job["images"], reply=result["text"])
            if job["aborted"]:
                st["reply"] = ""
            else:
                served.append(job)
    # The oracle: each served prompt from token 0, alone, in this engine; conversation 0's last
    # turn last, so the warm runs below hit what it cached.
    last = [job for job in served if job["conversation"] == 0][-1]
    for job in [*(j for j in served if j is not last), last]:
        if not llm.reset_prefix_cache():
            raise RuntimeError(f"{job['id']}: vLLM did not reset the prefix cache")
        cold = {**job, "id": job["id"] + "-cold", "abort_after": None}
        (sent,) = _send(engine, params, [cold], counts)
        emit(_result(name, sent, "cold"))
    # Conversation 0's first and last turns again: primed cold, warm (a hit on the primed blocks),
    # then warm over zeroed Mamba states.
    first = next(job for job in served if job["conversation"] == 0)
    for target in (first, last):
        for kind in ("prime", "warm", "broken"):
            if kind == "prime" and not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset the prefix cache")
            if kind == "broken" and not all(llm.collective_rpc(zero_mamba_states)):
                raise RuntimeError("no Mamba state to break")
            again = {**target, "id": f"{target['id']}-{kind}", "abort_after": None}
            (sent,) = _send(engine, params, [again], counts)
            emit(_result(name, sent, kind))
    emit({"phase": name, "kind": "totals", "counts": counts(), "standins": _standin_stats(llm)})


def zero_mamba_states(worker: Any) -> int:
    """Runs in each worker (``collective_rpc``): zero every Mamba layer's cached states, all
    blocks. Returns the number of state tensors zeroed."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    zeroed = 0
    context = worker.model_runner.compilation_config.static_forward_context
    for layer in context.values():
        if isinstance(layer, MambaBase):
            for state in layer.kv_cache:
                state.zero_()
                zeroed += 1
    return zeroed


def standin_stats(worker: Any) -> dict[str, dict[str, int]]:
    """Runs in each worker: the CPU kernel stand-ins' launch and copy counts (``biased_copies``:
    state copies at an accepted-token offset), empty where they are not bound."""
    import sys

    module = sys.modules.get("e2e_cpu_mamba_spec")
    return {name: dict(stats) for name, stats in getattr(module, "STATS", {}).items()}


def _standin_stats(llm: Any) -> dict[str, dict[str, int]]:
    (stats, *_) = llm.collective_rpc(standin_stats)
    return stats
