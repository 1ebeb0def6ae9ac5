"""The run file's schema, made from ``plancc apply``'s own options: one definition of every key,
its type and its bounds (a flag's ``min``/``max`` is the key's ``minimum``/``maximum``).

    python -m plancc.cli.run_schema          # rewrite plancc/schemas/run.schema.json and schemas/run.schema.json

``tests/test_run_file.py`` fails when either file differs from what this makes, so a flag added,
renamed or bounded anew cannot leave the run file behind.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from .app import app

# apply's parameters that are no key of a run file: the plan is ``plan``, the file itself, the format
_NOT_KEYS = frozenset({"plan_path", "config", "fmt"})
# keys whose type a flag's annotation does not say alone: --nnodes is N or MIN:MAX (a number in YAML
# too), --lr and --lora-alpha take an integer as YAML writes 1 for 1.0
_TYPES: dict[str, list[str]] = {"nnodes": ["string", "integer"], "lr": ["number", "integer"]}
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", Path: "string"}

_HEADER: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://plancc.dev/schemas/run.schema.json",
    "title": "plancc run file",
    "description": "Everything `plancc apply` takes, in one file: each key is a flag of apply (--save-every is "
    "save_every); flags on the command line override it. plancc apply --config RUN.yaml; plancc validate RUN.yaml.",
    "type": "object",
    "additionalProperties": False,
    "required": ["plancc_run", "plan"],
}


def _apply_options() -> list[Any]:
    group: Any = typer.main.get_command(app)  # typer's own click: its parameters carry min and max
    return [p for p in group.commands["apply"].params if p.name not in _NOT_KEYS]


def _key(option: Any) -> dict[str, Any]:
    annotation = option.type_descriptor.annotation
    kinds = list(_TYPES.get(option.name) or [_JSON_TYPES.get(annotation, "string")])
    if option.name == "lora_alpha":
        kinds = ["number", "integer"]
    if option.default is None:
        kinds.append("null")
    found: dict[str, Any] = {"type": kinds[0] if len(kinds) == 1 else kinds, "description": option.help or ""}
    if isinstance(annotation, type) and issubclass(annotation, Enum):  # --lr-schedule: its choices
        found["enum"] = [choice.value for choice in annotation]
    if option.min is not None:
        found["minimum"] = option.min
    if option.max is not None:
        found["maximum"] = option.max
    return found


def run_schema_of_flags() -> dict[str, Any]:
    properties: dict[str, Any] = {
        "plancc_run": {"const": 1, "description": "run-file format version"},
        "plan": {"type": "string", "description": "the plan YAML file (apply's PLAN)"},
    }
    properties.update({option.name: _key(option) for option in _apply_options()})
    return {**_HEADER, "properties": properties}


def schema_text() -> str:
    return json.dumps(run_schema_of_flags(), indent=2) + "\n"


SCHEMA_FILES = ("plancc/schemas/run.schema.json", "schemas/run.schema.json")  # the packaged one, the editors'


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    for name in SCHEMA_FILES:
        (root / name).write_text(schema_text())


if __name__ == "__main__":
    main()
