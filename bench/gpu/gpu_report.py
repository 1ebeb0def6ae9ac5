"""What the one-GPU bench scripts do last: print their results (bytes as MiB) and write them as
JSON for docs/measurements/."""

from __future__ import annotations

import json


def report(result: dict, out: str | None) -> None:
    for key, value in result.items():
        shown = f"{value / 2**20:.1f} MiB" if key.endswith("bytes") else value
        print(f"{key:40s} {shown}")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
