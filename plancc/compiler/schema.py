"""Validate a parsed plan against ``schemas/plan.schema.json`` and map every jsonschema
error to a diagnostic at the key or value the user wrote.

The schema owns the shape of a plan; this module only translates its verdicts into
messages that say what was found, what was allowed, and how to fix it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import resources
from typing import Any

import jsonschema
from jsonschema import Draft202012Validator

from ..errors import Diagnostic, SourceLoc, closest, did_you_mean
from .source import JsonPath, SourceDoc
from .styles import HF_UNSUPPORTED, STYLE_NAMES

SUPPORTED_VERSIONS = (1,)


@cache
def plan_schema() -> dict[str, Any]:
    return json.loads(resources.files("plancc").joinpath("schemas/plan.schema.json").read_text())


@cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(plan_schema())


def _allowed_keys(schema: dict[str, Any]) -> list[str]:
    return sorted(schema.get("properties", {}))


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref and ref.startswith("#/$defs/"):
        return plan_schema()["$defs"][ref.removeprefix("#/$defs/")]
    return schema


def _describe(value: Any) -> str:
    kind = {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)
    if isinstance(value, (dict, list)):
        return kind
    return f"{kind} ({value!r})"


_TYPE_WORDS = {
    "object": "a mapping",
    "array": "a list",
    "string": "a string",
    "boolean": "true or false",
    "integer": "an integer",
}


def _where(at: JsonPath) -> str:
    return ".".join(str(p) for p in at) or "the plan"


# One function per kind of jsonschema verdict: (the error, where the value sits, the document)
# -> the diagnostics it means. jsonschema types its attributes loosely (``Unset``); the
# values are read once, typed, into ``_Verdict``.
@dataclass(frozen=True, slots=True)
class _Verdict:
    error: jsonschema.ValidationError
    at: JsonPath
    instance: Any
    expected: Any  # the validator's value: the required keys, the enum, the type
    schema: dict[str, Any]


def _unknown_keys(v: _Verdict, doc: SourceDoc) -> Iterator[Diagnostic]:
    allowed = _allowed_keys(v.schema)
    for key in v.instance:
        if key in allowed:
            continue
        hint = did_you_mean(key, allowed)
        yield Diagnostic(
            rule="unknown-key",
            loc=doc.loc(v.at + (key,), key=True),
            message=f"unknown key {key!r} in {_where(v.at)}; allowed: {', '.join(allowed)}",
            fix=(hint + " " if hint else "") + f"remove {key!r} or use one of the allowed keys",
        )


def _missing_keys(v: _Verdict, doc: SourceDoc) -> Iterator[Diagnostic]:
    for key in [k for k in v.expected if k not in v.instance]:
        yield Diagnostic(
            rule="missing-key",
            loc=doc.loc(v.at),
            message=f"required key {key!r} is missing from {_where(v.at)}",
            fix=f"add '{key}:' (see plans/qwen3.yaml for a complete plan)",
        )


def _bad_version(v: _Verdict, doc: SourceDoc) -> Iterator[Diagnostic]:
    yield Diagnostic(
        rule="unsupported-version",
        loc=doc.loc(v.at),
        message=f"plan format version {v.instance!r} is not supported; "
        f"this plancc reads versions {', '.join(map(str, SUPPORTED_VERSIONS))}",
        fix="set 'plancc: 1' (or upgrade plancc)",
    )


def _not_in_enum(v: _Verdict, doc: SourceDoc) -> Iterator[Diagnostic]:
    allowed = [str(x) for x in v.expected]
    hint = did_you_mean(str(v.instance), allowed)
    yield Diagnostic(
        rule="invalid-value",
        loc=doc.loc(v.at),
        message=f"{_where(v.at)} is {_describe(v.instance)}; allowed: {', '.join(allowed)}",
        fix=hint or f"use one of: {', '.join(allowed)}",
    )


def _bad_glob(v: _Verdict, doc: SourceDoc) -> Iterator[Diagnostic]:
    # propertyNames errors point at the mapping (the bad glob is a key); list items and
    # `module:` values point at the value itself.
    on_value = _value_at(doc.data, v.at) == v.instance
    yield Diagnostic(
        rule="invalid-glob",
        loc=doc.loc(v.at) if on_value else doc.loc(v.at + (v.instance,), key=True),
        message=f"{v.instance!r} is not a valid module glob",
        fix="write a dotted module path such as 'model.layers.*.mlp.up_proj' "
        "('*' matches one segment, '**' any number; no spaces or empty segments)",
    )


def _wrong_type(v: _Verdict, doc: SourceDoc) -> Iterator[Diagnostic]:
    types = [v.expected] if isinstance(v.expected, str) else v.expected
    words = " or ".join(_TYPE_WORDS.get(t, t) for t in types)
    yield Diagnostic(
        rule="wrong-type",
        loc=doc.loc(v.at),
        message=f"{_where(v.at)} is {_describe(v.instance)}; expected {words}",
        fix=_type_fix(v.at, words),
    )


def _other(v: _Verdict, doc: SourceDoc) -> Iterator[Diagnostic]:
    yield Diagnostic(
        rule="invalid-value", loc=doc.loc(v.at), message=f"{_where(v.at)}: {v.error.message}", fix=_value_fix(v.error)
    )


def _handler(v: _Verdict) -> Callable[[_Verdict, SourceDoc], Iterator[Diagnostic]]:
    validator, at = v.error.validator, v.at
    if validator == "additionalProperties":
        return _unknown_keys
    if validator == "required":
        return _missing_keys
    if validator == "const" and at == ("plancc",):
        return _bad_version
    if validator == "anyOf" and _is_style_position(at):
        return lambda v, doc: _style_diagnostics(v.error, doc, v.at)
    if validator == "anyOf" and len(at) == 2 and at[0] == "activation_checkpointing":
        return lambda v, doc: _checkpoint_target_diagnostics(v.error, doc, v.at)
    if validator == "pattern" and v.schema is _resolve({"$ref": "#/$defs/glob"}):
        return _bad_glob
    return {"enum": _not_in_enum, "type": _wrong_type}.get(str(validator), _other)


def _diagnostics_for(error: jsonschema.ValidationError, doc: SourceDoc) -> Iterator[Diagnostic]:
    schema = error.schema if isinstance(error.schema, dict) else {}
    verdict = _Verdict(
        error=error,
        at=tuple(error.absolute_path),
        instance=error.instance,
        expected=error.validator_value,
        schema=schema,
    )
    yield from _handler(verdict)(verdict, doc)


def _value_at(data: Any, at: JsonPath) -> Any:
    for part in at:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _is_style_position(at: JsonPath) -> bool:
    return len(at) >= 2 and at[0] in ("tensor_parallel", "sequence_parallel")


def _style_diagnostics(error: jsonschema.ValidationError, doc: SourceDoc, at: JsonPath) -> Iterator[Diagnostic]:
    value = error.instance
    if isinstance(value, str):
        yield _unknown_style(value, doc, at)
        return
    if isinstance(value, dict):
        name = value.get("style")
        if isinstance(name, str) and name not in STYLE_NAMES:
            yield _unknown_style(name, doc, at + ("style",))
        elif "style" in value and not isinstance(name, str):  # a mapping, a list, a number: no enum names it
            yield Diagnostic(
                rule="wrong-type",
                loc=doc.loc(at + ("style",)),
                message=f"'style' of {at[-1]!r} is {_describe(name)}; expected a style name",
                fix="write a name from `plancc styles`, e.g. 'style: colwise', with its options beside it",
            )
        # The mapping branch's (index 1 of anyOf) own errors: unknown keys, bad layouts.
        for sub in error.context or ():
            if sub.relative_schema_path[0] != 1 or sub.validator == "enum":
                continue  # the name branch, or an unknown name reported above with closest names
            if sub.validator == "pattern":
                yield _invalid_layout(sub.instance, doc.loc(tuple(sub.absolute_path)))
            else:
                yield from _diagnostics_for(sub, doc)
        return
    yield Diagnostic(
        rule="wrong-type",
        loc=doc.loc(at),
        message=f"the style of {at[-1]!r} is {_describe(value)}; expected a style name or a mapping with 'style:'",
        fix="write a name from `plancc styles`, e.g. 'colwise'",
    )


_SHARD = re.compile(r"^shard\((-?[0-9]+)\)$")


def _invalid_layout(value: Any, loc: SourceLoc) -> Diagnostic:
    """A layout that is no placement, or a shard of a dim no activation has (torch's ``Shard``
    would fail to build, or shard nothing, at run time)."""
    dim = _SHARD.match(value) if isinstance(value, str) else None
    if dim is not None:
        return Diagnostic(
            rule="invalid-layout",
            loc=loc,
            message=f"{value!r} shards dim {dim.group(1)}, which no activation has: activations are "
            "[batch, sequence, features] (q/k/v: [batch, sequence, heads, head_dim]), dims -4 to 3",
            fix="use 'shard(-1)' for features, 'shard(1)' for the sequence, or 'replicate'",
        )
    return Diagnostic(
        rule="invalid-layout",
        loc=loc,
        message=f"{value!r} is not a layout",
        fix="use 'replicate' or 'shard(DIM)', e.g. 'shard(1)' for the sequence dim",
    )


def _checkpoint_target_diagnostics(
    error: jsonschema.ValidationError, doc: SourceDoc, at: JsonPath
) -> Iterator[Diagnostic]:
    """An ``activation_checkpointing`` item that is neither a glob nor a ``{module, save}``
    mapping: report the branch the user evidently meant."""
    branch = 1 if isinstance(error.instance, dict) else 0 if isinstance(error.instance, str) else None
    if branch is None:
        yield Diagnostic(
            rule="wrong-type",
            loc=doc.loc(at),
            message=f"{_where(at)} is {_describe(error.instance)}; expected a module glob or "
            "a mapping {module: GLOB, save: [...]}",
            fix="write e.g. 'model.layers.*.mlp' or '{module: model.layers.*, save: [matmul]}'",
        )
        return
    for sub in error.context or ():
        if sub.relative_schema_path[0] == branch:
            yield from _diagnostics_for(sub, doc)


@lru_cache(maxsize=1024)
def _closest_style(name: str) -> list[str]:
    return closest(name, STYLE_NAMES)


def _unknown_style(name: str, doc: SourceDoc, at: JsonPath) -> Diagnostic:
    if name in HF_UNSUPPORTED:
        return Diagnostic(
            rule="unsupported-style",
            loc=doc.loc(at),
            message=f"{name!r} is a transformers tp_plan style that plancc does not support: {HF_UNSUPPORTED[name]}",
            fix="leave the module out of the plan (its weight stays whole), or see `plancc styles`",
        )
    near = _closest_style(name)
    return Diagnostic(
        rule="unknown-style",
        loc=doc.loc(at),
        message=f"unknown style {name!r}"
        + (f"; closest: {', '.join(near)}" if near else "; see `plancc styles` for the vocabulary"),
        fix=f"use {near[0]!r}" if near else "pick a style from `plancc styles`",
    )


def _type_fix(at: JsonPath, words: str) -> str:
    examples: dict[JsonPath, str] = {
        ("architectures",): "write a list: architectures: [Qwen3ForCausalLM]",
        ("tensor_parallel",): "write a mapping of module glob to style, e.g. 'lm_head: colwise_logits'",
        ("sequence_parallel",): "write a mapping of module glob to style, e.g. 'model.norm: sequence_parallel'",
        ("fsdp",): "write 'fsdp: {units: [model.layers.*]}'",
        ("activation_checkpointing",): "write a list of module globs, e.g. [model.layers.*], or "
        "{module: GLOB, save: [matmul]} items for selective checkpointing",
    }
    return examples.get(at, f"make {_where(at)} {words}")


def _value_fix(error: jsonschema.ValidationError) -> str:
    if error.validator == "minItems":
        return "list at least one entry"
    if error.validator == "uniqueItems":
        return "remove the repeated entry"
    if error.validator == "pattern":
        return f"match the pattern {error.validator_value}"
    return "see schemas/plan.schema.json for what is allowed here"


def validate_doc(doc: SourceDoc) -> list[Diagnostic]:
    """All schema problems of a document, in file order."""
    found: list[Diagnostic] = []
    seen: set[tuple] = set()
    for error in _validator().iter_errors(doc.data):
        for diag in _diagnostics_for(error, doc):
            key = (diag.line, diag.column, diag.rule, diag.message)
            if key not in seen:
                seen.add(key)
                found.append(diag)
    return sorted(found, key=lambda d: (d.line, d.column))
