import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
