"""What the differential generator reaches (issue 35 item 2), counted apart from the oracle.

The suite stops a test at its first failing workload, so a run on a release with a known
counterexample counts little. This draws N workloads per strategy, runs each with the plugin
as registered, and tallies `_differential.reached` per category:

    python -m tests.properties._reach 40 sync+mtp2      # N, mode (on the vLLM `import vllm` finds)
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter

from hypothesis.errors import NonInteractiveExampleWarning

from tests.properties import _diff_workloads as wl
from tests.properties import _differential as diff
from tools.sched_harness import MODES_BY_NAME


def main(argv: list[str]) -> int:
    n, mode = int(argv[0]), MODES_BY_NAME[argv[1] if len(argv) > 1 else "sync+mtp2"]
    warnings.simplefilter("ignore", NonInteractiveExampleWarning)
    for name, strategy in (("crowd", wl.crowd), ("boundary", wl.boundary)):
        tally: Counter[str] = Counter()
        for _ in range(n):
            workload = strategy(mode).example()
            with diff.registered():
                run = diff.drive(workload, mode)
            tally.update(diff.reached(workload, mode, run))
            tally["workloads"] += 1
        print(f"{name} ({mode}): {dict(sorted(tally.items()))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
