"""What the launcher needs to say that a rank ran out of host memory, instead of reporting a
bare SIGKILL (and a ``--timeout`` hint) for it.

The kernel's OOM killer ends a process with SIGKILL and no message: the rank cannot say what
killed it. So each rank records its own peak resident memory as it runs (a file in the
launcher's folder, rewritten as the peak grows), and the launcher compares the kernel's count
of OOM kills (its memory cgroup's own, where the ranks run; ``/proc/vmstat``'s host-wide
``oom_kill`` where no cgroup count is readable) before and after the run: a rank that died of
SIGKILL while the count rose was the OOM killer's, and its last recorded peak is what it reached.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

SAMPLE_S = 0.1  # how often a rank reads its resident memory
GROWTH = 1.02  # a peak is written again when it grew by 2%
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def peak_file(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.peak"


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``), 0 where there is none to read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class PeakRecorder(threading.Thread):
    """A daemon thread that keeps ``peak_file(folder, rank)`` at this rank's peak resident bytes."""

    def __init__(self, folder: str | Path, rank: int) -> None:
        super().__init__(name="plancc-peak-memory", daemon=True)
        self.path = peak_file(folder, rank)
        self.written = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_S):
            now = resident_bytes()
            if now > self.written * GROWTH:
                self._write(now)

    def _write(self, value: int) -> None:
        try:
            fresh = self.path.with_suffix(".tmp")
            fresh.write_text(str(value))
            os.replace(fresh, self.path)
            self.written = value
        except OSError:  # the launcher's folder went away (the run ended): nothing to record into
            self._stop_event.set()

    def stop(self) -> None:
        self._stop_event.set()


def read_peak(folder: str | Path, rank: int) -> int | None:
    try:
        return int(peak_file(folder, rank).read_text())
    except (OSError, ValueError):
        return None


def oom_kills() -> int | None:
    """The kernel's count of OOM kills so far: this process's memory cgroup's (its ranks', not
    another job's on the same host: a SIGKILL that met some other job's OOM kill is not blamed on
    memory), else the host's; None where neither can be read."""
    for path, key in (
        (_cgroup_file("memory.events.local"), "oom_kill"),  # cgroup v2, this cgroup's own
        (_cgroup_file("memory.events"), "oom_kill"),  # cgroup v2 before 5.7 (its descendants' too)
        (_cgroup_file("memory.oom_control"), "oom_kill"),  # cgroup v1 (its own)
        ("/proc/vmstat", "oom_kill"),
    ):
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def _cgroup_file(name: str) -> str:
    """``name`` in this process's memory cgroup (v2's unified one, or v1's memory controller)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return "/nonexistent"
    for _, controllers, path in lines:
        if controllers == "memory":
            return f"/sys/fs/cgroup/memory{path}/{name}"
    for _, controllers, path in lines:
        if controllers == "":
            return f"/sys/fs/cgroup{path}/{name}"
    return "/nonexistent"


def memory_limit() -> int | None:
    """This process's memory cgroup limit in bytes, None where it has none (or none is readable)."""
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = Path(_cgroup_file(name)).read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit() or int(text) >= 1 << 62:
            return None
        return int(text)
    return None


def cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup still allows (its limit less what it holds), None
    where it has no limit: a container's bound, which the host's MemAvailable does not show."""
    limit = memory_limit()
    if limit is None:
        return None
    for name in ("memory.current", "memory.usage_in_bytes"):
        try:
            return max(0, limit - int(Path(_cgroup_file(name)).read_text().strip()))
        except (OSError, ValueError):
            continue
    return limit


@dataclass(frozen=True, kw_only=True, slots=True)
class OutOfMemory:
    """A rank the OOM killer ended (``oom_killer``), or one that died of SIGKILL with no count
    to tell (``oom_killer`` None), with the peak it recorded."""

    rank: int
    peak: int | None
    oom_killer: bool | None
