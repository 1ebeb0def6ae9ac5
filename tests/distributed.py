"""The one place tests start processes: torch's elastic launcher (torchrun's machinery),
one process per rank, gloo on CPU, a free local port for the c10d rendezvous.

``launch(fn, nproc, *args)`` runs ``fn(*args)`` on every rank and returns {rank: result};
``fn`` must be a module-level function (its reference is pickled to the workers).
``forked_ranks()`` has plancc's own launcher, run in the test process, fork its ranks the
same way (``tests.conftest.forked_cli``). ``launch_beside`` starts a second job (a rollout
engine) beside the one a test launches, and ``ForkedProcess`` one process of its own (a weight
receiver), both from the same server.

Workers are forked from a forkserver that imported torch, transformers and plancc once per
test session: a spawned worker spends ~5 s of CPU importing them, every launch, on a 2-core
machine. The server only imports (no tensor op ran in it, so no thread pool is forked); each
worker then gets the test's environment as it is at the launch (``_in_test_env``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def _method_name(depth: int = 2) -> str:
    """What torch's ``dynamic_rendezvous.get_method_name`` returns, the name of the function
    ``depth`` frames up, without its two ``inspect.stack()`` calls: they read the source of every
    frame on the stack, and a rendezvous records a dozen events. At the depth of a test in a
    pytest-xdist worker that was ~0.3-1 s of the worker's CPU a launch, ~150 launches a run."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


dynamic_rendezvous.get_method_name = _method_name


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (what ``bind(0)`` and outgoing connections get)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range. A port the kernel handed out for
    ``bind(0)`` is one it also hands to outgoing connections -- and the suite's gloo groups open
    many: between this call and the server's own bind, one took it (EADDRINUSE, seen once in a
    weight channel's rendezvous). A port below the range is only ever taken by another bind."""
    low = _ephemeral_low()
    picker = random.Random()  # the tests' seeded global stream must not pick the same ports
    for _ in range(200):
        port = picker.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a host with the range taken: the kernel's pick, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what workers import (the modeling files of the tiny presets' families included)
_PRELOAD = [
    "torch",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gemma3.modeling_gemma3",
    "transformers.models.phi3.modeling_phi3",
    "plancc",
    "plancc.job.verify",
    "plancc.runtime.vocab_parallel_logprobs",
    "plancc.job.runner",  # the ranks of plancc's own launcher (forked_ranks)
    "peft",  # the LoRA tests' unsharded reference (skipped where the extra is not installed)
]


def _take_env(env: dict[str, str]) -> None:
    """The launching test's environment in a forked worker (the forkserver holds the one of the
    first launch); the agent's per-rank variables are not in it and stay."""
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    tempfile.tempdir = None  # computed again from this TMPDIR


def _in_test_env(fn, env: dict[str, str], *args):
    """Run ``fn`` with the launching test's environment."""
    _take_env(env)
    return fn(*args)


def launch(fn, nproc: int, *args, timeout_s: int = 240):
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"plancc-test-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": timeout_s},
        max_restarts=0,
        monitor_interval=0.2,
        start_method="forkserver",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return elastic_launch(config, _in_test_env)(fn, dict(os.environ), *args)


def _ensure_forkserver() -> None:
    """The forkserver up, its socket in this process's temporary folder as it is now (a test's
    own TMPDIR is too deep for an AF_UNIX path: start it before taking one)."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    forkserver.ensure_running()


def launch_beside(fn, nproc: int, *args, timeout_s: int = 240) -> Future:
    """``launch(fn, nproc, *args)`` in a thread of this process, beside the job the test launches
    itself (a rollout engine of its own): its ranks forked from the same server, not from a server
    of another interpreter that imports torch and transformers again (~11 s of CPU). torch's
    agent installs its signal handlers in the main thread only; the test's own launch keeps them.
    The future's ``result(timeout)`` is {rank: result}, or raises what the launch raised
    (``ChildFailedError``: a rank failed)."""
    _ensure_forkserver()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launch-beside")
    try:
        return pool.submit(launch, fn, nproc, *args, timeout_s=timeout_s)
    finally:
        pool.shutdown(wait=False)


def _output_to(out: str, err: str) -> None:
    """This process's stdout and stderr into files (a process forked from the server writes to
    the server's terminal otherwise); appended, so that both may be one file."""
    for fd, path in ((1, out), (2, err)):
        with open(path, "a") as f:
            os.dup2(f.fileno(), fd)


def _captured(fn, env: dict[str, str], log: str, args) -> None:
    """In a process forked from the server: ``fn(*args)`` with the test's environment, its output
    in ``log``, and the int it returns as the process's exit code."""
    import torch

    _take_env(env)
    torch.set_num_threads(1)
    _output_to(log, log)
    code = fn(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code or 0)


class ForkedProcess:
    """``fn(*args)`` in a process of its own, forked from the test forkserver instead of started as
    ``python -m tests.…`` (which imports torch and plancc again, ~7 s of CPU): the part of
    ``subprocess.Popen`` the tests use -- ``communicate`` (its stdout and stderr together),
    ``returncode`` (what ``fn`` returned; minus the signal that ended it) and ``kill``."""

    def __init__(self, fn, *args):
        _ensure_forkserver()
        fd, self._log = tempfile.mkstemp(prefix="plancc-forked-", suffix=".log")
        os.close(fd)
        self._process = multiprocessing.get_context("forkserver").Process(
            target=_captured, args=(fn, dict(os.environ), self._log, args))
        self._process.start()

    @property
    def returncode(self):
        return self._process.exitcode

    def communicate(self, timeout: float):
        import subprocess

        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return Path(self._log).read_text(errors="replace"), None

    def kill(self):
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()
        with contextlib.suppress(OSError):
            os.unlink(self._log)


def init_gloo(timeout_s: int = 120):
    """In a worker: the default process group on gloo with a timeout on every collective."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _runner_rank(argv: list[str], env: dict[str, str], out_dir: str) -> None:
    """A ``plancc apply``/``logprobs`` rank forked from the forkserver: ``plancc.job.runner``'s
    ``main`` as its ``python -m`` would run it, with the launcher's environment, and this rank's
    stdout and stderr in files the launching test reads back (a forked rank writes to the
    forkserver's terminal otherwise)."""
    from plancc.job import runner

    _take_env(env)
    rank = os.environ["RANK"]
    _output_to(os.path.join(out_dir, f"rank-{rank}.out"), os.path.join(out_dir, f"rank-{rank}.err"))
    code = runner.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)  # the agent sees the exit code the runner's process would have ended with


@contextlib.contextmanager
def forked_ranks():
    """While inside, plancc's launcher (torchrun's ``run``, run in this process) starts its ranks
    from this test process's forkserver instead of ``python -m plancc.job.runner``: the same agent,
    rendezvous, runner and exit codes, without an interpreter importing torch and transformers per
    rank (~6.5 s of CPU each on this host). The ranks' output is printed, in rank order, once the
    ranks end. Tests of the launcher's own process handling (signals, a killed launcher or rank)
    start the real CLI instead (``run_cli``)."""
    import dataclasses
    import torch.distributed.run as torchrun

    _ensure_forkserver()  # before this test's TMPDIR is taken
    real = torchrun.elastic_launch
    out_dir = tempfile.mkdtemp(prefix="plancc-forked-")

    def launch_forked(config, entrypoint):
        def call(*cmd_args):
            args = list(cmd_args)
            assert args[:3] == ["-u", "-m", "plancc.job.runner"], args  # what plancc's launcher runs
            forked = dataclasses.replace(config, start_method="forkserver")
            try:
                return real(forked, _runner_rank)(args[3:], dict(os.environ), out_dir)
            finally:
                for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
                    for path in sorted(Path(out_dir).glob(f"rank-*.{name}"), key=lambda p: int(p.stem[5:])):
                        stream.write(path.read_text())
                        path.unlink()

        return call

    environ, tempdir = dict(os.environ), tempfile.tempdir
    # the agent handles these four in the process that runs it; plancc's launcher gives back two
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    torchrun.elastic_launch = launch_forked
    tempfile.tempdir = None  # the launcher's temporary folders under this test's TMPDIR, as in its own process
    try:
        yield
    finally:
        torchrun.elastic_launch = real
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        tempfile.tempdir = tempdir
        os.environ.clear()
        os.environ.update(environ)  # the launcher's OMP_NUM_THREADS and the like stay with it
        shutil.rmtree(out_dir, ignore_errors=True)


def sized(**sizes):
    """``plancc.Layout`` of this launched rank's world from axis sizes, dp inferred where not
    given (``sp`` is ``sequence_parallel``): what the tests' layout dicts mean."""
    import plancc

    if "sp" in sizes:
        sizes["sequence_parallel"] = sizes.pop("sp")
    return plancc.Layout.infer(world_size=int(os.environ["WORLD_SIZE"]), **sizes)
