"""A worker process's life around the job: a stop request (SIGINT / SIGTERM) agreed at a step
boundary, the launcher's death noticed within a second, and a failing rank's traceback kept in a
file of its own."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .config import RunConfig


class StopRequest:
    """SIGINT / SIGTERM ask the run to stop at the next step boundary instead of killing it
    mid-step (no traceback, no half-written checkpoint). Ctrl-C reaches every worker at
    once, and the launcher forwards the signal again; every signal only sets the flag, and
    the launcher's shutdown grace (SIGKILL after it) bounds how long a stuck worker lingers.
    Ranks agree on stopping through a one-integer all-reduce per step, so all stop together."""

    signum = 0

    @classmethod
    def install(cls) -> None:
        def request(signum: int, _frame: Any) -> None:
            cls.signum = cls.signum or signum

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, request)

    @classmethod
    def agreed(cls, device: str) -> int:
        """The signal any rank received (0: none), the same on every rank (a collective)."""
        flag = torch.tensor([cls.signum], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


EXIT_ORPHANED = 5
PARENT_POLL_S = 0.5


class LauncherWatch:
    """End this worker within a second of its launcher's death.

    The elastic agent runs inside the ``plancc`` process; if that process is SIGKILLed
    nothing tells the workers, and they would train to the end (and write checkpoints no
    one asked for any more). A daemon thread watches the parent pid; once the worker is
    re-parented it exits at once, and local rank 0 first removes the temporary folders the
    launcher can no longer clean up (plancc's result folder, the agent's log folder).
    Polling rather than ``PR_SET_PDEATHSIG``: the agent starts workers from a thread, and the
    signal would fire when that thread ends. Whichever way the worker ends while orphaned
    (the watch, or a collective failing first), ``main`` cleans up the same way.
    """

    def __init__(self, result_path: str | None):
        self.parent = os.getppid()
        self.leftovers = [Path(result_path).parent] if result_path else []
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            self.leftovers += [p for p in Path(error_file).parents if p.name.startswith("torchelastic_")]

    def orphaned(self) -> bool:
        return os.getppid() != self.parent

    def exit_if_orphaned(self) -> None:
        if not self.orphaned():
            return
        if os.environ.get("LOCAL_RANK") == "0":
            for folder in self.leftovers:
                if folder.name.startswith(("plancc-", "torchelastic_")):
                    shutil.rmtree(folder, ignore_errors=True)
        os._exit(EXIT_ORPHANED)

    def start(self) -> LauncherWatch:
        def watch() -> None:
            while True:
                time.sleep(PARENT_POLL_S)
                self.exit_if_orphaned()

        threading.Thread(target=watch, name="plancc-launcher-watch", daemon=True).start()
        return self


EXIT_FAILED = 1


def log_traceback(cfg: RunConfig, exc: Exception) -> None:
    """A failing rank's full traceback into its log (the launcher names the file in the one
    line it prints), not onto the terminal, where every victim rank's trace of a peer's death
    would bury the line that says which rank failed. Without a log folder: stderr, as before."""
    trace = "".join(traceback.format_exception(exc))
    if cfg.logging.log_dir is None:
        print(trace, file=sys.stderr, flush=True)
        return
    path = Path(cfg.logging.log_dir) / f"rank-{os.environ.get('RANK', '0')}.log"
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_text(trace)
    except OSError:  # a full disk: the agent still has the error's last line
        print(trace, file=sys.stderr, flush=True)
