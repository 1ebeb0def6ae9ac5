"""What `plancc apply`'s launcher imports before any worker starts: its checks of flags, plan,
data and folders run in the launcher, and every launch pays for what it imports (seconds of
CPU, once per job)."""

import subprocess
import sys


def test_the_launchers_checks_import_neither_dcp_nor_dtensor_nor_transformers_models():
    code = (
        "import sys, plancc.cli, plancc.job.preflight, plancc.job.launch\n"
        "heavy = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor', 'transformers.models')"
        " if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
