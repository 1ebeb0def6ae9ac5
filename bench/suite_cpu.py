"""Where the test suite's CPU goes: every Python process the README command starts, by kind.

    python bench/suite_cpu.py [--workers 2] [-- PYTEST ARGS...]

Runs ``python -m pytest -q -p no:cacheprovider -n WORKERS --dist loadfile`` (the README
command) with a ``sitecustomize`` on ``PYTHONPATH`` that makes every Python process append its
own CPU time (user + system, ``RUSAGE_SELF``), its command line and the test that started it to
a JSON-lines file when it exits, ``os._exit`` included (plancc's workers and multiprocessing's
children end that way). Nothing is installed; the suite itself is unchanged. Prints the run's
wall time, the CPU of each kind of process (the two pytest-xdist workers, ``plancc apply``
launchers, their ``python -m plancc.job.runner`` ranks, ranks forked from the tests'
forkserver, other scripts), the share of both cores that was busy, and the test files whose
processes cost the most. A process killed by a signal writes nothing: the kill tests' ranks
are missing, a few seconds of CPU. docs/testing.md has the latest results.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_HOOK = """
import atexit, json, os, resource, sys

_LOG = os.environ.get("PLANCC_SUITE_CPU")
if _LOG:
    _pid0 = os.getpid()

    def _record():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        record = {"argv": [a[:200] for a in sys.argv[:3]], "forked": os.getpid() != _pid0,
                  "pid": os.getpid(), "ppid": os.getppid(),
                  "cpu": usage.ru_utime + usage.ru_stime,
                  "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" (")[0]}
        try:
            with open(_LOG, "a") as f:
                f.write(json.dumps(record) + "\\n")
        except OSError:
            pass

    _exit = os._exit

    def _recorded_exit(code):
        _record()
        _exit(code)

    os._exit = _recorded_exit
    atexit.register(_record)
"""


def kind(record: dict) -> str:
    first = record["argv"][0] if record["argv"] else ""
    if first.endswith("runner.py"):
        return "plancc apply/logprobs ranks (python -m plancc.job.runner)"
    if record["forked"]:
        return "ranks forked from a test forkserver"
    if first.endswith(("cli.py", "cli/__main__.py")) or "plancc.cli" in record["argv"][:3]:
        return "plancc CLI processes (launchers, validate)"
    if first == "-c":
        return "pytest-xdist workers and forkservers"
    return "other scripts (examples, channel and reshard workers, ray)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (-n)")
    parser.add_argument("--records", type=Path, help="also write every process's record (JSON lines) here")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        Path(tmp, "sitecustomize.py").write_text(_HOOK)
        log = Path(tmp, "processes.jsonl")
        path = os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "PLANCC_SUITE_CPU": str(log)}
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            str(args.workers),
            "--dist",
            "loadfile",
            *args.pytest_args,
        ]
        start = time.monotonic()
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        if args.records is not None and log.exists():
            args.records.write_text(log.read_text())
    print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"pytest exited {proc.returncode}")
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    by_file: dict[str, float] = collections.Counter()
    for record in records:
        by_kind[kind(record)].append(record["cpu"])
        if record["forked"] or record["argv"][:1] != ["-c"]:  # not an xdist worker or a forkserver
            by_file[record["test"].split("::")[0] or "(no test)"] += record["cpu"]
    total = sum(sum(v) for v in by_kind.values())
    cores = os.cpu_count() or 1
    print(f"wall {wall:.0f} s, CPU {total:.0f} s: {total / (wall * cores):.0%} of {cores} cores busy")
    for name, cpus in sorted(by_kind.items(), key=lambda item: -sum(item[1])):
        print(f"  {sum(cpus):7.0f} s  {len(cpus):4d} processes  {sum(cpus) / len(cpus):5.1f} s each  {name}")
    print("processes other than the xdist workers, by the test that started them:")
    for name, cpu in sorted(by_file.items(), key=lambda item: -item[1])[:15]:
        print(f"  {cpu:7.0f} s  {name}")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
