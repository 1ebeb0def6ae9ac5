"""The typed plan: what a schema-valid YAML document means, with a source location on
every rule so later stages (resolve, checks, lowering) can point back at the user's line."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import Diagnostic, PlanError, SourceLoc, raise_if_errors
from ..schedules import stages_per_rank
from .declarations import positional_count
from .lora_spec import LoraSpec
from .schema import validate_doc
from .source import JsonPath, SourceDoc, parse_yaml, read_yaml
from .styles import ALIASES, canonical_style, format_layout, parse_layout


@dataclass(frozen=True, kw_only=True, slots=True)
class StyleRef:
    """A style name (canonical, aliases resolved) plus the overrides of the mapping form."""

    name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    written_as: str = ""  # the name in the file, when it was an alias

    def describe(self) -> str:
        if not self.overrides:
            return self.name
        extra = ", ".join(f"{k}={_show(v)}" for k, v in self.overrides.items())
        return f"{self.name}({extra})"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return format_layout(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    pattern: str
    style: StyleRef
    loc: SourceLoc
    optional: bool = False
    section: str = "tensor_parallel"


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetList:
    """A list of module globs (FSDP units, activation-checkpointing targets)."""

    patterns: tuple[str, ...] = ()
    locs: tuple[SourceLoc, ...] = ()
    # activation checkpointing: per pattern, the operator groups whose outputs are kept
    # (empty: full recompute)
    saves: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardPlacement:
    """``fsdp.shard_placement``: the parameters a glob names, sharded by FSDP on ``dim``."""

    pattern: str
    dim: int
    loc: SourceLoc


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSpec:
    """The plan's ``pipeline:`` section: the schedule, the microbatches a step, the stages each
    rank holds, and (optionally) the module globs of every stage in order."""

    schedule: str = "1f1b"
    microbatches: int | None = None  # None: one per pipeline rank
    virtual_stages_per_rank: int = 1
    # or the stages' size, the stage count derived from the model's layers (``per_rank``)
    layers_per_stage: int | None = None
    # the even split's weights of the embedding and the lm_head, in layers (torchtitan's)
    first_stage_less_layers: int = 0
    last_stage_less_layers: int = 0
    stages: tuple[tuple[str, ...], ...] = ()
    stage_locs: tuple[SourceLoc, ...] = ()
    loc: SourceLoc = field(default_factory=lambda: SourceLoc(path="<plan>"))

    def per_rank(self, layers: int, pp: int) -> int:
        """The stages each of ``pp`` ranks holds for a decoder of ``layers`` layers:
        ``virtual_stages_per_rank``, or what ``layers_per_stage`` makes of the layers
        (``ValueError`` where that is not whole rounds of pp or not the schedule's count)."""
        if self.layers_per_stage is None:
            return self.virtual_stages_per_rank
        return stages_per_rank(
            self.schedule,
            pp,
            layers,
            self.layers_per_stage,
            self.first_stage_less_layers,
            self.last_stage_less_layers,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileSpec:
    """The plan's ``compile:`` section: each decoder block compiled with ``torch.compile``."""

    backend: str = "inductor"
    fullgraph: bool = False
    loc: SourceLoc = field(default_factory=lambda: SourceLoc(path="<plan>"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    name: str
    version: int
    architectures: tuple[str, ...]
    tensor_parallel: tuple[Rule, ...]
    sequence_parallel: tuple[Rule, ...] = ()
    fsdp_units: TargetList = TargetList()
    fsdp_reshard_after_forward: bool = True
    # parameter glob -> the dim FSDP shards it on (FSDP2's shard_placement_fn; dim 0 otherwise)
    fsdp_shard_placement: tuple[ShardPlacement, ...] = ()
    activation_checkpointing: TargetList = TargetList()
    lora: LoraSpec | None = None
    pipeline: PipelineSpec | None = None
    compile: CompileSpec | None = None  # None: eager
    description: str = ""
    path: str = "<plan>"
    loc: SourceLoc = field(default_factory=lambda: SourceLoc(path="<plan>"))
    # the YAML read (once: the path may be a pipe): a launcher hands it on to its workers
    text: str = field(default="", repr=False, compare=False)


def _rules(doc: SourceDoc, section: str, problems: list[Diagnostic]) -> tuple[Rule, ...]:
    rules = []
    for pattern, value in (doc.data.get(section) or {}).items():
        at = (section, pattern)
        fields = {"style": value} if isinstance(value, str) else dict(value)
        written = fields.pop("style")
        optional = bool(fields.pop("optional", False))
        spec = canonical_style(written)
        overrides: dict[str, Any] = {}
        for key, raw in fields.items():
            if key not in spec.overridable:
                allowed = ", ".join(sorted(spec.overridable)) or "none"
                problems.append(
                    Diagnostic(
                        rule="style-override",
                        loc=doc.loc(at + (key,), key=True),
                        message=f"style {spec.name!r} does not take {key!r}; it takes: {allowed}",
                        fix=f"remove {key!r}, or use 'prepare_input'/'prepare_output' for a custom layout",
                    )
                )
                continue
            overrides[key] = _override(raw)
        mismatch = _mismatched_inputs(overrides)
        if mismatch is not None:
            problems.append(
                Diagnostic(
                    rule="style-override",
                    loc=doc.loc(at, key=True),
                    message=f"{spec.name} of {pattern!r}: {mismatch}",
                    fix="give one input layout and one desired layout per positional input (null for one left "
                    "alone), and the same names in both keyword tables",
                )
            )
        rules.append(
            Rule(
                pattern=pattern,
                style=StyleRef(name=spec.name, overrides=overrides, written_as=written if written in ALIASES else ""),
                loc=doc.loc(at, key=True),
                optional=optional,
                section=section,
            )
        )
    return tuple(rules)


def _override(raw: Any) -> Any:
    """A schema-valid override as the declaration holds it: a layout; a tuple of them, one per
    positional input (None: left alone); keyword layouts as sorted (name, layout) pairs."""
    if isinstance(raw, (bool, int)):
        return raw
    if isinstance(raw, list):
        return tuple(None if item is None else parse_layout(item) for item in raw)
    if isinstance(raw, dict):
        return tuple(sorted((name, parse_layout(text)) for name, text in raw.items()))
    return parse_layout(raw)


def _mismatched_inputs(overrides: dict[str, Any]) -> str | None:
    """Input layouts torch's PrepareModuleInput refuses at build time: a list of positional
    layouts whose length differs from the desired ones, keyword layouts of other names."""
    given, wanted = overrides.get("input_layouts"), overrides.get("desired_input_layouts")
    if isinstance(given, tuple) or isinstance(wanted, tuple):
        if given is None or wanted is None:
            return "a list of positional layouts needs both input_layouts and desired_input_layouts"
        if positional_count(given) != positional_count(wanted):
            return (
                f"input_layouts has {positional_count(given)} layout(s), "
                f"desired_input_layouts {positional_count(wanted)}"
            )
    names = {k for k, _ in overrides.get("input_kwarg_layouts", ())}
    desired = {k for k, _ in overrides.get("desired_input_kwarg_layouts", ())}
    if names != desired:
        return f"input_kwarg_layouts names {sorted(names)}, desired_input_kwarg_layouts {sorted(desired)}"
    return None


def _targets(doc: SourceDoc, at: tuple) -> TargetList:
    node = doc.data
    for key in at:
        node = node.get(key) if isinstance(node, dict) else None
    patterns = tuple(node or ())
    return TargetList(patterns=patterns, locs=tuple(doc.loc(at + (i,)) for i in range(len(patterns))))


def _shard_placements(doc: SourceDoc) -> tuple[ShardPlacement, ...]:
    table = (doc.data.get("fsdp") or {}).get("shard_placement") or {}
    return tuple(
        ShardPlacement(
            pattern=pattern,
            dim=int(text[len("shard(") : -1]),
            loc=doc.loc(("fsdp", "shard_placement", pattern), key=True),
        )
        for pattern, text in table.items()
    )


def _checkpoint_targets(doc: SourceDoc) -> TargetList:
    """``activation_checkpointing`` items: a glob (full recompute) or
    ``{module: GLOB, save: [GROUP, ...]}`` (selective)."""
    patterns, locs, saves = [], [], []
    for i, item in enumerate(doc.data.get("activation_checkpointing") or ()):
        if isinstance(item, dict):
            patterns.append(item["module"])
            locs.append(doc.loc(("activation_checkpointing", i, "module")))
            saves.append(tuple(item.get("save", ())))
        else:
            patterns.append(item)
            locs.append(doc.loc(("activation_checkpointing", i)))
            saves.append(())
    return TargetList(patterns=tuple(patterns), locs=tuple(locs), saves=tuple(saves))


def _lora(doc: SourceDoc) -> LoraSpec | None:
    data = doc.data.get("lora")
    if data is None:
        return None
    targets = data.get("targets") or []
    return LoraSpec.of(
        data,
        loc=doc.loc(("lora",), key=True),
        target_locs=tuple(doc.loc(("lora", "targets", i)) for i in range(len(targets))),
    )


def _compile(doc: SourceDoc) -> CompileSpec | None:
    data = doc.data.get("compile")
    if data is None or data is False:
        return None
    options = data if isinstance(data, dict) else {}
    return CompileSpec(
        backend=options.get("backend", "inductor"),
        fullgraph=options.get("fullgraph", False),
        loc=doc.loc(("compile",), key=True),
    )


def _pipeline(doc: SourceDoc, problems: list[Diagnostic]) -> PipelineSpec | None:
    data = doc.data.get("pipeline")
    if data is None:
        return None
    stages = data.get("stages") or []
    if "layers_per_stage" in data:
        for other in ("virtual_stages_per_rank", "stages"):
            if other in data:  # two answers to how many stages: the plan says one
                problems.append(
                    Diagnostic(
                        loc=doc.loc(("pipeline", other), key=True),
                        message=f"pipeline: both layers_per_stage and {other} say how the layers are staged",
                        rule="pipeline",
                        fix=f"keep one: layers_per_stage (the stage count follows the model) or {other}",
                    )
                )
    return PipelineSpec(
        schedule=data.get("schedule", "1f1b"),
        microbatches=data.get("microbatches"),
        virtual_stages_per_rank=data.get("virtual_stages_per_rank", 1),
        layers_per_stage=data.get("layers_per_stage"),
        first_stage_less_layers=data.get("first_stage_less_layers", 0),
        last_stage_less_layers=data.get("last_stage_less_layers", 0),
        stages=tuple(tuple(globs) for globs in stages),
        stage_locs=tuple(doc.loc(("pipeline", "stages", i)) for i in range(len(stages))),
        loc=doc.loc(("pipeline",), key=True),
    )


def plan_from_doc(doc: SourceDoc) -> Plan:
    """Build a ``Plan`` from a parsed document; raise ``PlanError`` with every problem."""
    raise_if_errors(validate_doc(doc))
    problems: list[Diagnostic] = []
    data = doc.data
    plan = Plan(
        name=data["name"],
        version=data["plancc"],
        description=data.get("description", ""),
        architectures=tuple(data["architectures"]),
        tensor_parallel=_rules(doc, "tensor_parallel", problems),
        sequence_parallel=_rules(doc, "sequence_parallel", problems),
        fsdp_units=_targets(doc, ("fsdp", "units")),
        fsdp_reshard_after_forward=(data.get("fsdp") or {}).get("reshard_after_forward", True),
        fsdp_shard_placement=_shard_placements(doc),
        activation_checkpointing=_checkpoint_targets(doc),
        lora=_lora(doc),
        pipeline=_pipeline(doc, problems),
        compile=_compile(doc),
        path=doc.path,
        loc=doc.loc(()),
        text=doc.text,
    )
    raise_if_errors(problems)
    return plan


@dataclass(frozen=True, kw_only=True, slots=True)
class PartialPlan:
    """A plan read without the rules the schema refused: what ``validate`` checks further, so
    that one run reports the schema's problems and every problem of the rest of the plan."""

    plan: Plan
    problems: tuple[Diagnostic, ...]  # the schema's, each inside one of the rules left out
    left_out: tuple[tuple[str, str], ...]  # (section, glob) of each rule left out


_RULE_SECTIONS = ("tensor_parallel", "sequence_parallel")


def _rule_lines(doc: SourceDoc) -> dict[int, tuple[str, str]]:
    """Line -> the (section, glob) of the style rule written on it (its key, its value, the
    keys of its mapping form)."""
    lines: dict[int, tuple[str, str]] = {}
    for section in _RULE_SECTIONS:
        rules = doc.data.get(section) if isinstance(doc.data, dict) else None
        if not isinstance(rules, dict):
            continue
        for glob, value in rules.items():
            paths: list[JsonPath] = [(section, glob)]
            if isinstance(value, dict):
                paths += [(section, glob, key) for key in value]
            for path in paths:
                for loc in (doc.key_locs.get(path), doc.value_locs.get(path)):
                    if loc is not None:
                        lines.setdefault(loc.line, (section, glob))
    return lines


def load_plan_partially(path: str | Path | SourceDoc) -> PartialPlan:
    """``load_plan``, except that schema problems each inside one style rule leave that rule
    out (reported, not checked further) rather than stop the reading. Raises ``PlanError`` as
    ``load_plan`` does for anything else (a missing key, a bad section, a bad file)."""
    doc = path if isinstance(path, SourceDoc) else read_yaml(path)
    problems = validate_doc(doc)
    if not any(d.is_error for d in problems):
        return PartialPlan(plan=plan_from_doc(doc), problems=tuple(problems), left_out=())
    owners = _rule_lines(doc)
    if not all(d.line in owners for d in problems if d.is_error):
        raise PlanError(problems)
    left_out = tuple(dict.fromkeys(owners[d.line] for d in problems if d.is_error))
    data = {
        key: ({g: v for g, v in value.items() if (key, g) not in left_out} if key in _RULE_SECTIONS else value)
        for key, value in doc.data.items()
    }
    reduced = replace(doc, data=data)
    if any(d.is_error for d in validate_doc(reduced)):  # the rules left out were not the only problem
        raise PlanError(problems)
    return PartialPlan(plan=plan_from_doc(reduced), problems=tuple(problems), left_out=left_out)


def load_plan(path: str | Path) -> Plan:
    """Read, parse and schema-validate a plan file.

    Raises ``PlanError`` holding one ``Diagnostic`` per problem (never a bare exception for
    a user mistake).
    """
    return plan_from_doc(read_yaml(path))


def parse_plan(text: str, path: str = "<plan>") -> Plan:
    """Like ``load_plan`` for YAML text already in memory."""
    return plan_from_doc(parse_yaml(text, path))
