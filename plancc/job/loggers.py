"""Experiment trackers beside ``--metrics`` and TensorBoard: ``--logger wandb`` (Weights &
Biases) and ``--logger mlflow``, optional extras, written by rank 0 with the numbers of the
metrics file and TensorBoard's names (``train/loss``, ``eval/loss``).

The metrics JSONL stays the one source: a tracker receives the same rows and nothing else, and
a tracker that fails mid-run (its server away) costs a warning, never the run. Each reads its
own environment as its users expect: ``WANDB_PROJECT``, ``WANDB_MODE=offline`` (what the tests
run), ``MLFLOW_TRACKING_URI`` (a local ``./mlruns`` without one), ``MLFLOW_EXPERIMENT_NAME``.
A run with ``--save`` keeps one W&B run across its resumes (the id is the save folder's).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

LOGGERS = {"wandb": "wandb", "mlflow": "mlflow"}  # --logger name: the module it imports
EXTRAS = {"wandb": "plancc[wandb]", "mlflow": "plancc[mlflow]"}
PROJECT = "plancc"  # the W&B project and MLflow experiment when the environment names none


def names_of(value: str | None) -> tuple[str, ...]:
    """``--logger wandb,mlflow`` as names (unknown ones are the preflight's to refuse)."""
    return tuple(part.strip() for part in (value or "").split(",") if part.strip())


def scalar_name(key: str) -> str:
    """A metrics-file key as trackers name it: ``eval_loss`` is ``eval/loss``, the rest ``train/...``."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


class _Wandb:
    def __init__(self, *, run_name: str, settings: dict[str, Any], run_id: str | None) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=run_name,
            config=settings,
            id=run_id,
            resume="allow" if run_id else None,
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, *, run_name: str, settings: dict[str, Any], run_id: str | None) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT))
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({key: str(value)[:500] for key, value in settings.items() if value is not None})

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


_MAKERS = {"wandb": _Wandb, "mlflow": _Mlflow}


class Trackers:
    """The trackers ``names`` asks for, on rank 0 (empty elsewhere): each step's row logged to
    every one, a failing one dropped with one warning."""

    def __init__(
        self, names: tuple[str, ...], *, rank0: bool, run_name: str, settings: dict[str, Any], save: str | None
    ):
        # one W&B run across resumes: its id is the checkpoint folder's
        run_id = hashlib.sha1(str(Path(save).resolve()).encode()).hexdigest()[:16] if save else None
        self.open: dict[str, Any] = {}
        for name in names if rank0 else ():
            try:
                self.open[name] = _MAKERS[name](run_name=run_name, settings=settings, run_id=run_id)
            except Exception as exc:  # a tracker is never worth the run
                _warn(name, exc)

    def log(self, row: dict[str, float]) -> None:
        values = {scalar_name(key): value for key, value in row.items() if key != "step"}
        for name, tracker in list(self.open.items()):
            try:
                tracker.log(values, int(row["step"]))
            except Exception as exc:
                _warn(name, exc)
                del self.open[name]

    def close(self) -> None:
        for name, tracker in self.open.items():
            try:
                tracker.close()
            except Exception as exc:
                _warn(name, exc)
        self.open = {}


def _warn(name: str, exc: BaseException) -> None:
    print(
        f"--logger {name}: warning: {type(exc).__name__}: {exc}; the run goes on (--metrics keeps every step)",
        file=sys.stderr,
        flush=True,
    )
