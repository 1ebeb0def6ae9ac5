"""One file that reproduces a run: ``plancc apply --config run.yaml``.

Every key is a flag of ``plancc apply`` (``--save-every N`` is ``save_every: N``; the plan is
``plan``), checked against ``schemas/run.schema.json`` -- made from the flags themselves, their
types and bounds (``plancc.cli.run_schema``) -- with the plans' ``file:line:col`` diagnostics; a
flag given on the command line overrides the file. A run with ``--save`` writes the settings it
ran with -- the file's and the flags' together -- into every checkpoint (``SAVE/step-N/run.yaml``,
published with it), so ``plancc apply --config SAVE/step-N/run.yaml --resume SAVE`` continues the
same run. Paths in the file are taken as written (relative ones from the directory the command
runs in, as flags are).
"""

from __future__ import annotations

import json
from enum import Enum
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

from ..compiler.source import SourceDoc, read_yaml
from ..errors import Diagnostic, PlanError, SourceLoc, closest

RULE = "run-file"
RUN_FILE = "run.yaml"  # the resolved settings a run with --save writes into each checkpoint
VERSION_KEY = "plancc_run"


@cache
def run_schema() -> dict[str, Any]:
    return json.loads(resources.files("plancc").joinpath("schemas/run.schema.json").read_text())


def is_run_file(path: str | Path) -> bool:
    """Whether a YAML file is a run file (its top level names ``plancc_run``), not a plan. Only a
    regular file is looked at, and only its first 64 KiB: a FIFO without a writer or an endless
    device given as a plan is the plan reader's to refuse (``plancc.inputs``), never waited on here."""
    try:
        if not Path(path).is_file():
            return False
        with open(path, "rb") as f:
            head = f.read(65536).decode("utf-8", errors="replace")
    except OSError:
        return False
    return any(line.split(":", 1)[0].strip() == VERSION_KEY for line in head.splitlines())


def read_run_file(path: str | Path) -> dict[str, Any]:
    """The settings of a run file, checked: a ``PlanError`` with every problem at its line and
    column otherwise (unknown keys with the nearest flag, wrong types, a missing plan)."""
    doc = read_yaml(path)  # syntax, size and alias-bomb limits as for plans
    problems = list(_problems(doc))
    if problems:
        raise PlanError(problems)
    return {key: value for key, value in doc.data.items() if key != VERSION_KEY}


def _problems(doc: SourceDoc) -> list[Diagnostic]:
    if not isinstance(doc.data, dict):
        kind = type(doc.data).__name__
        return [
            Diagnostic(
                rule=RULE,
                loc=SourceLoc(path=doc.path, line=1, column=1),
                message=f"a run file is a mapping of apply's flags to values; found {kind}",
                fix=f"start it with '{VERSION_KEY}: 1' and 'plan: plans/qwen3.yaml'",
            )
        ]
    schema = run_schema()
    allowed = sorted(schema["properties"])
    found = []
    for error in Draft202012Validator(schema).iter_errors(doc.data):
        at = tuple(error.absolute_path)
        if error.validator == "additionalProperties":
            for key in sorted(set(error.instance) - set(allowed)):
                near = closest(str(key), allowed, n=1)
                found.append(
                    Diagnostic(
                        rule=RULE,
                        loc=doc.loc((key,), key=True),
                        message=f"unknown key {key!r}: a run file's keys are apply's flags",
                        fix=f"did you mean {near[0]!r}?" if near else "see `plancc apply --help` for the flags",
                    )
                )
        elif error.validator == "required":
            found.append(
                Diagnostic(
                    rule=RULE,
                    loc=SourceLoc(path=doc.path, line=1, column=1),
                    message=f"the run file has no {error.message.split()[0]}",
                    fix=f"add '{VERSION_KEY}: 1' and 'plan: PATH' at the top",
                )
            )
        else:
            key = str(at[0]) if at else "the run file"
            flag = f"--{key.replace('_', '-')}"
            if error.validator in ("minimum", "maximum") and at:  # the flag's own bound
                bound = f">= {error.validator_value}" if error.validator == "minimum" else f"<= {error.validator_value}"
                takes, fix = (
                    f"{bound} (the bound of {flag})",
                    f"write {key}: as `plancc apply {flag}` takes it ({bound})",
                )
            else:
                known = schema["properties"].get(key, {})
                takes, fix = (
                    _allowed(known.get("type", known.get("const"))),
                    f"write {key}: as `plancc apply {flag}` takes it",
                )
            found.append(
                Diagnostic(
                    rule=RULE, loc=doc.loc(at), message=f"{key} is {error.instance!r}; allowed: {takes}", fix=fix
                )
            )
    return sorted(found, key=lambda d: (d.line, d.column))


def _allowed(expected: Any) -> str:
    kinds = expected if isinstance(expected, list) else [expected]
    return " or ".join("nothing (null)" if k == "null" else f"{k}" for k in kinds)


def run_file_text(values: dict[str, Any]) -> str:
    """The settings a run runs with as a run file's text: every checkpoint holds it
    (``SAVE/step-N/run.yaml``), so ``plancc apply --config SAVE/step-N/run.yaml --resume SAVE``
    continues the same run."""
    known = run_schema()["properties"]
    plain: dict[str, Any] = {VERSION_KEY: 1}
    plain.update({k: _plain(v) for k, v in values.items() if k in known})
    head = "# the settings this run ran with (its run file and flags together)\n"
    return head + yaml.safe_dump(plain, sort_keys=False)


def _plain(value: Any) -> Any:
    """A flag's value as YAML writes it: a path or a choice (``--lr-schedule``) as its text."""
    if isinstance(value, Path):
        return str(value)
    return value.value if isinstance(value, Enum) else value


def plan_of_run_file(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(the plan a run file names, its settings): what ``plancc validate RUN.yaml`` checks the
    plan with (its model and layout)."""
    settings = read_run_file(path)
    return Path(settings["plan"]), settings
