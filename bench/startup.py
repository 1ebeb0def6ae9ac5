"""Start-up time of the commands a user and the pre-commit hook run most: `plancc --help`,
`plancc validate plans/qwen3.yaml` (built-in preset: checked on its shipped skeleton), and
the same check on the real transformers model (what `validate` cost before skeletons), each
in a fresh process, interleaved round by round so drift on a shared machine hits all alike.

    python bench/startup.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = str(ROOT / "plans" / "qwen3.yaml")
REAL = "from plancc.checks.report import validate_plan; import sys; sys.exit(validate_plan(sys.argv[1], skeleton=False).has_errors)"

COMMANDS = {
    "plancc --help": [sys.executable, "-m", "plancc.cli", "--help"],
    "plancc validate plans/qwen3.yaml": [sys.executable, "-m", "plancc.cli", "validate", PLAN],
    "validate on the real model (before)": [sys.executable, "-c", REAL, PLAN],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, argv in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True)
            times[name].append(time.perf_counter() - start)
    before = statistics.median(times["validate on the real model (before)"])
    print(f"{'command':<40} {'median s':>9} {'min s':>7} {'x before':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<40} {median:>9.2f} {min(values):>7.2f} {median / before:>9.2f}")


if __name__ == "__main__":
    main()
