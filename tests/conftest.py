import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# No test may depend on wall-clock speed: hypothesis' default 200 ms deadline per example and
# its too-slow health check fail property tests on a loaded machine (CI saw it). Bounds that
# catch a hang are per test (pytest-timeout), with room.
settings.register_profile("plancc", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("plancc")

# The README command's two xdist workers and the ranks they start share two cores: a test process
# with an OpenMP pool of a thread per core oversubscribes them, and the pool's threads spin while
# they wait (the same in-process tests beside a busy core: 24-27 s of CPU with one thread, 36-37 s
# with two; docs/testing.md). Rank processes set their own (tests/distributed.py, plancc's launcher).
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the extended tier: further fault points and signals of behaviours the default run "
                          "covers once, scale tests, layouts a larger one subsumes (docs/testing.md)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``extended`` are skipped (and counted as skipped) unless ``--extended``.

    The files with the most multi-rank (``slow``) tests run first: ``-n 2 --dist loadfile`` hands
    out whole files in collection order, and a long file handed out last kept one worker busy
    while the other sat idle (alphabetically, tests/test_runner.py: ~40 s of a 16-minute run,
    docs/testing.md). A stable sort: a file's tests keep their order and stay together."""
    slow = Counter(item.nodeid.split("::")[0] for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.nodeid.split("::")[0]])
    if "rollout" not in (config.getoption("-m") or ""):  # a real vLLM: only when asked for
        later = pytest.mark.skip(reason="rollout tier: pytest -m rollout, with vLLM's environment (docs/rollout.md)")
        for item in items:
            if "rollout" in item.keywords:
                item.add_marker(later)
    if config.getoption("--extended"):
        return
    skip = pytest.mark.skip(reason="extended tier: pytest --extended (docs/testing.md)")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_rank():
    """A real world of one rank (gloo; nccl too where a GPU is): a fake process group's
    all-gather leaves its output unwritten, which torch 2.11 showed as NaN weights."""
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def write_plan(tmp_path):
    """Write YAML text to a plan file and return its path."""

    def write(text: str, name: str = "plan.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


@pytest.fixture
def cli():
    """Run the plancc CLI in-process: returns (exit code, stdout, stderr)."""
    from typer.testing import CliRunner

    from plancc.cli import app

    runner = CliRunner()

    def run(*args: str):
        result = runner.invoke(app, [str(a) for a in args])
        if result.exception and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result.exit_code, result.stdout, result.stderr

    return run


def forked_cli(*args):
    """The plancc CLI run in this test process, its ranks forked from the test forkserver
    (``tests.distributed.forked_ranks``): (exit code, stdout, stderr), the ranks' output after
    the launcher's lines of before the launch. For tests of what the ranks compute; tests of how
    the launcher starts, signals and reaps processes use ``run_cli``, as a user would."""
    from typer.testing import CliRunner

    from plancc.cli import app

    from .distributed import forked_ranks

    with forked_ranks():
        result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def run_cli(*args, env=None, timeout=240, **popen):
    """Run the plancc CLI in its own process, as a user would: (exit code, stdout, stderr)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "plancc.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, **popen)
    return proc.returncode, proc.stdout, proc.stderr


def step_losses(stdout: str) -> list[float]:
    return [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]


def once_per_run(tmp_path_factory, name: str, make):
    """``make(folder)``'s JSON result, computed by one pytest-xdist worker for the whole run.

    A session fixture is per worker, and with ``-n 2`` the two workers would each pay the
    same launches. The first to take the lock makes the result in a folder shared by the
    run's workers; the other waits for it and reads it back."""
    import fcntl
    import json

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, result = shared / name, shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result.exists():
            folder.mkdir(exist_ok=True)
            result.write_text(json.dumps(make(folder)))
    return folder, json.loads(result.read_text())


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint of the tiny Qwen3 saved by `plancc apply` at step 2 (the default layout: dp=2), and the losses
    of steps 3 and 4 resumed from it: the reference the checkpoint tests compare with. Shared
    by every test that needs one (each works on its own copy), as saving costs a launch."""

    def make(root):
        code, _, err = forked_cli("apply", PLANS / "qwen3.yaml", "--steps", 2, "--save", root / "ck")
        assert code == 0, err
        code, out, err = forked_cli("apply", PLANS / "qwen3.yaml", "--steps", 4, "--resume", root / "ck")
        assert code == 0, err
        assert "resumed from step 2" in out
        return step_losses(out)

    root, losses = once_per_run(tmp_path_factory, "tiny-checkpoint", make)
    return root / "ck", losses


@pytest.fixture(scope="session")
def fp32_run(tmp_path_factory):
    """`plancc apply --steps 3 --tp 2 --format json` on the tiny Qwen3 (fp32, seed 0): (exit code,
    stdout, stderr). The baseline the determinism and mixed-precision tests share."""
    _, run = once_per_run(tmp_path_factory, "fp32-run", lambda _: forked_cli(
        "apply", PLANS / "qwen3.yaml", "--steps", 3, "--tp", 2, "--format", "json"))
    return tuple(run)


def assert_verified(results, cases, min_params=15):
    """Every rank's report of every case within ``--verify``'s own bars: fp32's, or twice the
    model's own fp32-vs-fp64 error where that is larger; tp replicas identical."""
    from plancc.job.verify import VerifyReport, within_tolerance

    for rank, reports in results.items():
        for i, case in enumerate(cases):
            report = reports[i]
            assert "error" not in report, report.get("trace")
            assert within_tolerance(VerifyReport(**report)), f"rank {rank} {case}: {report}"
            assert report["replicas_identical"] and report["params_compared"] >= min_params
