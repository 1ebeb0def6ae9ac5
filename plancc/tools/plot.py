"""``plancc plot``: the loss curve, gradient norm and throughput (and an RL loop's reward and KL)
of a ``--metrics`` file, as a
PNG (matplotlib, an optional extra: ``pip install 'plancc[plot]'``)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from ..errors import Diagnostic, PlanError, SourceLoc

PANELS = (
    ("loss", "loss"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens / s"),
    ("reward", "reward"),  # an RL loop's (examples/grpo.py)
    ("kl", "KL to the reference"),
)


def _problem(path: Path, line: int, message: str, fix: str, rule: str = "metrics-file") -> PlanError:
    return PlanError(
        [
            Diagnostic(
                rule=rule, loc=SourceLoc(path=str(path), line=line, column=1 if line else 0), message=message, fix=fix
            )
        ]
    )


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a ``--metrics`` JSONL file; a line that is not one is an error at its line."""
    if not path.is_file():
        raise _problem(path, 0, "no such metrics file", "pass the file plancc apply --metrics wrote", "file-not-found")
    rows = []
    with path.open(errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _problem(
                    path, number, f"not a JSON line: {exc.msg}", "pass a file written by --metrics"
                ) from None
            if (
                not isinstance(row, dict)
                or not isinstance(row.get("step"), int)
                or not isinstance(row.get("loss"), int | float)
            ):
                raise _problem(
                    path,
                    number,
                    'a metrics line needs "step" (an integer) and "loss" (a number)',
                    "pass a file written by --metrics",
                )
            rows.append(row)
    if not rows:
        raise _problem(path, 0, "the metrics file has no steps", "plot after at least one step has finished")
    return rows


# what matplotlib's Agg canvas writes, by the output's extension
FORMATS = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".tif", ".tiff", ".webp", ".eps", ".ps", ".pgf")


def _output_problem(out: Path) -> PlanError | None:
    fix = "pass -o a file such as metrics.png in an existing folder"
    if out.suffix.lower() not in FORMATS:
        what = f"a {out.suffix!r} file" if out.suffix else "a file without an extension"
        return _problem(
            out,
            0,
            f"cannot draw {what}: the formats are {', '.join(FORMATS)}",
            fix,
            "usage",
        )
    if not out.parent.is_dir():
        return _problem(out, 0, f"-o names a file in {out.parent}, which does not exist", fix, "usage")
    return None


# Beyond this a panel's axis range (max - min) overflows a float and matplotlib cannot lay it out
_LARGEST = 1e300


def _drawable(value: object) -> bool:
    """A number a panel can draw: NaN, inf (a diverged step) and overflowing values are left
    out of the line, as a gap, rather than failing the whole plot."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and abs(value) <= _LARGEST
    )


def plot(path: Path, out: Path) -> int:
    """Draw the panels into ``out``; returns the number of steps drawn."""
    problem = _output_problem(out)
    if problem is not None:
        raise problem
    if importlib.util.find_spec("matplotlib") is None:
        raise PlanError(
            [
                Diagnostic(
                    rule="usage",
                    loc=SourceLoc(path="plot"),
                    message="plancc plot needs matplotlib, which is not installed",
                    fix="pip install 'plancc[plot]' (or pip install matplotlib)",
                )
            ]
        )
    rows = read_metrics(path)
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    panels = [(key, label) for key, label in PANELS if any(key in row for row in rows)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.7 * len(panels)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    for ax, (key, label) in zip(axes, panels, strict=True):
        points = [(r["step"], r[key]) for r in rows if _drawable(r.get(key))]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].set_title(path.name)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except OSError as exc:  # a full disk, /dev/full, a folder without write permission
        raise _problem(out, 0, f"cannot write the plot: {exc.strerror or exc}", "pass -o a writable file") from None
    except (ValueError, OverflowError) as exc:  # a layout matplotlib cannot compute from these values
        raise _problem(path, 0, f"cannot draw these metrics: {exc}", "check the file's values") from None
    finally:
        plt.close(fig)
    return len(rows)
