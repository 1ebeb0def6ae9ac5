"""What a worker of ``plancc apply`` / ``plancc logprobs`` shows and records: rank 0's log lines,
the progress of a run, and its per-step metrics (``--metrics``, ``--tensorboard``)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .loggers import Trackers, scalar_name


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True, file=LOG_STREAM[0])


# Where rank 0's log lines go: stdout for people, stderr when stdout carries data (JSON output,
# or log-probs written to stdout). Set once by main().
LOG_STREAM = [sys.stdout]


class RunProgress:
    """A rich progress bar on a terminal (rank 0); one plain line per step otherwise, so
    logs and tests read the same numbers."""

    def __init__(self, total: int):
        self.bar = None
        if dist.get_rank() == 0 and sys.stdout.isatty():
            self.bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total)
            self.bar.start()

    def step(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line)
            self.bar.advance(self.task)
        else:
            log(line)

    def advance(self) -> None:
        """A step whose line is not shown (``--log-every``): the bar moves on."""
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class MetricsFile:
    """``--metrics FILE.jsonl``: rank 0 writes one JSON line per step (the numbers the
    progress line shows, plus this rank's peak memory and the time since the run started),
    flushed at once so a killed run keeps every finished step. A run resumed from step ``start``
    continues the file after that step: the lines of later steps (a run that went on past its
    checkpoint before it stopped), and a line cut short by a kill, are dropped first, so each
    step has one line and a plot of the file is the resumed run's curve.
    ``--tensorboard DIR``: the same numbers as TensorBoard scalars (``train/loss``, ...), the
    events past ``start`` purged on a resume (``SummaryWriter``'s ``purge_step``) likewise;
    ``--logger``'s trackers (``job.loggers``) get the same rows."""

    def __init__(
        self,
        path: str | None,
        *,
        start: int,
        device: str,
        tensorboard: str | None = None,
        trackers: Trackers | None = None,
    ):
        rank0 = dist.get_rank() == 0
        if path and rank0 and start > 0:
            _keep_steps_through(Path(path), start)
        self.file = open(path, "a" if start > 0 else "w") if path and rank0 else None  # noqa: SIM115
        self.board: Any = None
        if tensorboard and rank0:
            from torch.utils.tensorboard import SummaryWriter  # the optional extra: checked before launch

            self.board = SummaryWriter(log_dir=tensorboard, purge_step=start + 1 if start > 0 else None)
        self.trackers = trackers  # --logger's (rank 0's, else none open)
        self.device = device
        self.started = time.perf_counter()

    def peak_memory(self) -> int:
        if self.device == "cuda":
            return int(torch.cuda.max_memory_allocated())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def write(self, row: dict[str, float]) -> None:
        if self.file is None and self.board is None and not (self.trackers and self.trackers.open):
            return
        line = {**row, "peak_memory_bytes": self.peak_memory(), "elapsed_s": time.perf_counter() - self.started}
        if self.file is not None:
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()
        if self.board is not None:
            for key, value in line.items():
                if key != "step":  # eval_loss is eval/loss
                    self.board.add_scalar(scalar_name(key), value, global_step=int(row["step"]))
            self.board.flush()
        if self.trackers is not None:
            self.trackers.log(line)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()
        if self.trackers is not None:
            self.trackers.close()


def _keep_steps_through(path: Path, last: int) -> None:
    """The metrics file with only the lines of steps up to ``last`` (whole JSON lines), replaced
    atomically: a kill while this runs leaves the old file or the new one."""
    if not path.is_file():
        return
    kept = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                step = json.loads(line).get("step")
            except (json.JSONDecodeError, AttributeError):
                continue  # a line cut short by the kill that stopped the run, or not ours
            if isinstance(step, int) and step <= last:
                kept.append(line if line.endswith("\n") else line + "\n")
    fresh = path.with_name(path.name + ".resumed")
    fresh.write_text("".join(kept), encoding="utf-8")
    os.replace(fresh, path)
