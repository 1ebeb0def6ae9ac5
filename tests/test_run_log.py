"""What a long run's log says: a step line with its throughput and the time left, every N-th
step with --log-every N (the first and the last always)."""

import pytest

from .conftest import PLANS

QWEN3 = PLANS / "qwen3.yaml"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_long_run_logs_every_nth_step_with_an_eta():
    from .conftest import forked_cli

    code, out, err = forked_cli("apply", QWEN3, "--steps", 7, "--log-every", 3, "--nproc-per-node", 1)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/7", "3/7", "6/7", "7/7"]  # the first, every 3rd, the last
    assert all(line.split()[-2] == "eta" and line.split()[-1].count(":") == 2 for line in lines)
