"""Start `plancc apply` workers with torch's elastic launcher (torchrun's own machinery:
the same rendezvous, multi-node flags, restarts and failure reporting)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.run import get_args_parser, run

from ..errors import quiet_logger
from ..runtime.mesh import THREADS_UNSET_BY_USER
from ..runtime.rank_memory import OutOfMemory, oom_kills, read_peak
from .config import DATA_COPY, EVAL_COPY, PLAN_COPY, RunConfig
from .data import TokenDataset, write_tokens

SHUTDOWN_TIMEOUT_S = 10


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchOptions:
    nproc_per_node: int = 2
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_id: str | None = None
    max_restarts: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchResult:
    ok: bool
    result: dict[str, Any] | None
    failures: dict[int, str]  # global rank -> error message
    first_failed: int | None = None  # the rank that failed first: the root cause
    interrupted: int = 0  # SIGINT / SIGTERM that stopped the job (the workers stop at a step boundary)
    rendezvous: str | None = None  # why the nodes never met (an endpoint no one answers at, a timeout)
    logs: dict[int, str] = field(default_factory=dict)  # global rank -> the file holding its full traceback
    out_of_memory: OutOfMemory | None = None  # the first failed rank was the kernel's OOM killer's


def torchrun_argv(opts: LaunchOptions, cfg: RunConfig, result_path: str) -> list[str]:
    # --timeout bounds the rendezvous too: connecting to the endpoint (torch's default: 60 s a
    # try) and waiting for every node to join (600 s)
    meet = f"join_timeout={cfg.training.timeout_s},read_timeout={cfg.training.timeout_s}"
    argv = [
        f"--nproc-per-node={opts.nproc_per_node}",
        f"--nnodes={opts.nnodes}",
        f"--max-restarts={opts.max_restarts}",
        "--monitor-interval=0.2",
        # the agent's grace between SIGTERM and SIGKILL (see _prompt_shutdown for the failure path)
        f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
    ]
    if opts.rdzv_endpoint:
        # torch reads --node-rank for the static backend only (and warns that c10d ignores it)
        argv += [f"--node-rank={opts.node_rank}"] if opts.rdzv_backend == "static" else []
        argv += [
            f"--rdzv-backend={opts.rdzv_backend}",
            f"--rdzv-endpoint={opts.rdzv_endpoint}",
            f"--rdzv-id={opts.rdzv_id or 'plancc'}",
            f"--rdzv-conf={meet}",
        ]
    else:
        argv += ["--standalone"]  # single node: rendezvous on a free local port
    return argv + ["--module", "plancc.job.runner", "--config", cfg.to_json(), "--result", result_path]


@contextmanager
def _installed_plancc() -> Iterator[None]:
    """The workers start as ``python -m plancc.job.runner``, which puts the working directory first
    on the import path: run from the folder above a clone (a ``plancc/`` folder there), they would
    import the clone's sources, or a folder of that name, not the plancc that launched them.
    PYTHONSAFEPATH (Python 3.11) leaves the working directory off their path."""
    before = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = before


@contextmanager
def _prompt_shutdown(grace_s: int) -> Iterator[None]:
    """torch 2.13's process context stops the workers of a failed group with ``close()``'s
    default 30 s between SIGTERM and SIGKILL, whatever ``--shutdown-timeout`` says: a worker
    that cannot take SIGTERM (SIGSTOPped, stuck in the kernel) kept a failed job alive 30 s
    more. While plancc's launcher runs the agent, the default is the configured grace; a
    torch whose ``close`` has another signature is left alone."""
    close = PContext.close
    if close.__defaults__ != (None, 30):
        yield
        return
    close.__defaults__ = (None, grace_s)
    try:
        yield
    finally:
        close.__defaults__ = (None, 30)


def launch(
    opts: LaunchOptions,
    cfg: RunConfig,
    *,
    plan_text: str,
    dataset: TokenDataset | None = None,
    eval_rows: TokenDataset | None = None,
) -> LaunchResult:
    """Run the job: ``plan_text``, ``dataset`` and ``eval_rows`` are the plan and data the caller
    read and checked; the workers get them from the launcher's private folder (``cfg.training.inputs``)."""
    if "OMP_NUM_THREADS" not in os.environ:  # quiets torchrun; the workers still share the cores out
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ[THREADS_UNSET_BY_USER] = "1"
    # a rank that fails makes this folder and writes its full traceback there (the terminal
    # gets one line); nothing is made for a run no rank of which fails
    logs = Path(tempfile.gettempdir()) / f"plancc-logs-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="plancc-") as tmp:
        result_path = str(Path(tmp) / "result.json")
        Path(tmp, PLAN_COPY).write_text(plan_text, encoding="utf-8")
        if dataset is not None:
            write_tokens(dataset, Path(tmp, DATA_COPY))
        if eval_rows is not None:
            write_tokens(eval_rows, Path(tmp, EVAL_COPY))
        cfg = cfg.with_flags(inputs=tmp, log_dir=str(logs))
        args = get_args_parser().parse_args(torchrun_argv(opts, cfg, result_path))
        failures: dict[int, str] = {}
        first = None
        interrupted = 0
        unmet = None
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        kills_before = oom_kills()
        out_of_memory = None
        try:
            # the agent logs each failed worker at ERROR; the CLI names the failure itself
            with (
                quiet_logger("torch.distributed.elastic", logging.CRITICAL),
                _prompt_shutdown(SHUTDOWN_TIMEOUT_S),
                _installed_plancc(),
            ):
                run(args)
        except ChildFailedError as exc:
            seen = []
            for rank, failure in sorted(exc.failures.items()):
                failures[rank] = _failure_message(failure)
                seen.append(RankFailure(rank, failures[rank], failure.exitcode, failure.timestamp))
            first = root_cause(seen)
            out_of_memory = _out_of_memory(exc.failures, first, tmp, kills_before)
        except SignalException as exc:  # the agent stopped the workers (with the same signal) and re-raised
            interrupted = int(exc.sigval)
        except RendezvousError as exc:  # no worker started: the nodes never met
            unmet = _rendezvous_message(exc, opts, cfg.training.timeout_s)
        finally:  # the agent's process context installed its own handlers: the caller's come back
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        result = json.loads(Path(result_path).read_text()) if Path(result_path).is_file() else None
    written = {int(log.stem.removeprefix("rank-")): str(log) for log in logs.glob("rank-*.log")}
    return LaunchResult(
        ok=not failures and not interrupted,
        result=result,
        failures=failures,
        first_failed=first,
        interrupted=interrupted,
        rendezvous=unmet,
        logs=written,
        out_of_memory=out_of_memory,
    )


def _out_of_memory(
    failures: dict[int, ProcessFailure], first: int | None, folder: str, kills_before: int | None
) -> OutOfMemory | None:
    """The first failed rank as the OOM killer's victim, when it died of SIGKILL and the kernel
    counted an OOM kill meanwhile (or has no count to read); None otherwise."""
    if first is None or failures[first].exitcode != _SIGKILL:
        return None
    after = oom_kills()
    killer = None if kills_before is None or after is None else after > kills_before
    if killer is False:  # a SIGKILL from someone else (a user, a scheduler): not memory
        return None
    return OutOfMemory(rank=first, peak=read_peak(folder, first), oom_killer=killer)


def _rendezvous_message(exc: RendezvousError, opts: LaunchOptions, timeout_s: int) -> str:
    cause = exc.__cause__ or exc.__context__
    why = str(cause or exc).strip().splitlines()[0][:200] if str(cause or exc).strip() else type(exc).__name__
    if isinstance(exc, RendezvousConnectionError):
        return f"no rendezvous at {opts.rdzv_endpoint} within --timeout {timeout_s} s: {why}"
    if isinstance(exc, RendezvousTimeoutError):
        return f"waited --timeout {timeout_s} s at {opts.rdzv_endpoint} for --nnodes {opts.nnodes}: not every node came"
    return f"the rendezvous at {opts.rdzv_endpoint} did not complete (--nnodes {opts.nnodes}): {why}"


@dataclass(frozen=True, slots=True)
class RankFailure:
    rank: int
    message: str
    exitcode: int
    timestamp: int  # seconds, as torch's elastic agent records them: ties are common


# What a rank says when a *peer* died under it: gloo/nccl/store errors. These ranks are
# victims; naming one of them as "the rank that failed" sends the user to the wrong log.
_PEER_ERROR = re.compile(
    r"closed by peer|reset by peer|remote worker|Broken pipe|DistNetworkError|"
    r"DistStoreError|NCCL.*(?:abort|watchdog)|ProcessGroup.*(?:abort|shut)",
    re.IGNORECASE,
)
# What a rank says when a collective waited past --timeout for a peer that never came: it is
# a victim of that peer (stopped, hung, or deadlocked), not the cause.
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_SIGTERM = -15  # how the elastic agent stops the survivors
_SIGKILL = -9  # how it stops a rank that ignores SIGTERM (a stopped or hung one)


def root_cause(failures: list[RankFailure]) -> int | None:
    """The rank whose own failure started the cascade: a rank that raised or died of its own
    accord beats one that lost a peer, which beats one the agent stopped; earliest, then
    lowest rank, inside each class (torch's timestamps alone tie at one-second resolution).

    When ranks timed out waiting, the cause is the rank they waited for, which never raised:
    the one the agent had to stop. A rank stopped with SIGSTOP (or hung) is killed by the
    agent long after its peers' timeouts, so neither time nor "who raised" points at it.
    """
    waited = any(_TIMEOUT.search(f.message) for f in failures)

    def signalled(f: RankFailure) -> bool:
        return f.message.startswith("killed by") or "SIGTERM" in f.message or "SIGKILL" in f.message

    def cause_class(f: RankFailure) -> int:
        if waited:
            # the rank everyone waited for ignored the agent's SIGTERM (stopped or hung) and
            # was killed; a rank that took SIGTERM may be it too, or a bystander
            if f.exitcode == _SIGKILL and signalled(f):
                return 0
            if f.exitcode == _SIGTERM and signalled(f):
                return 1
            return 2 if _TIMEOUT.search(f.message) or _PEER_ERROR.search(f.message) else 0
        if _PEER_ERROR.search(f.message):
            return 1
        if f.exitcode == _SIGTERM and signalled(f):
            return 2
        return 0

    if not failures:
        return None
    return min(failures, key=lambda f: (cause_class(f), f.timestamp, f.rank)).rank


def _failure_message(failure: ProcessFailure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
        if isinstance(message, dict):
            message = message.get("message", str(message))
    text = str(message or "").strip()
    if not text or text.startswith("To enable traceback"):
        signal = failure.signal_name() if failure.exitcode < 0 else None
        text = f"killed by {signal}" if signal else f"exited with code {failure.exitcode}"
    return text.splitlines()[0] if "Traceback" not in text else text.strip().splitlines()[-1]
