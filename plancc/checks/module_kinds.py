"""style-module-kind: a style must fit the module it is applied to."""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.kinds import own_parameters
from ..compiler.styles import STYLES, canonical_style
from ..errors import Severity
from .context import CheckContext, Problem, kind_of
from .example import Example

ID = "style-module-kind"


EXAMPLES = (
    Example(verdict="PASS", text="model.layers.*.mlp.up_proj (Linear): colwise", args={"tp": 2}),
    Example(
        verdict="FAIL",
        text="model.layers.*.mlp (Qwen3MLP): colwise -> torch would raise NotImplementedError at run time",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.mlp", "colwise"),),
    ),
    Example(
        verdict="FAIL",
        text="model.norm (RMSNorm): rotary_sp",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.norm", "rotary_sp"),),
    ),
)


def check(ctx: CheckContext) -> Iterator[Problem]:
    reported: set[tuple[str, str]] = set()
    # per_head_params on a glob: some layers' attention may have no sinks (sliding-window layers
    # only); the style passes those by, but a rule whose every module lacks them is a mistake
    holds_parameters: dict[str, bool] = {}
    for _, module, rule, _ in ctx.assigned():
        holds_parameters[rule.pattern] = holds_parameters.get(rule.pattern, False) or bool(own_parameters(module))
    for name, module, rule, _ in ctx.assigned():
        spec = canonical_style(rule.style.name)
        kind = kind_of(module)
        if (rule.pattern, rule.section) in reported:
            continue
        if kind in spec.module_kinds and spec.name == "per_head_params" and not holds_parameters[rule.pattern]:
            reported.add((rule.pattern, rule.section))
            # a warning: the block trains exactly as it would without the rule (bench/plan_mutations.py)
            yield Problem(
                loc=rule.loc,
                severity=Severity.WARNING,
                message=f"{rule.pattern} ({type(module).__name__}) has no parameters of its own; 'per_head_params' "
                "shards an attention block's own per-head parameters (learned sinks): here it does nothing",
                fix="drop the rule (the block's projections carry its sharding)",
            )
            continue
        if kind in spec.module_kinds:
            continue
        reported.add((rule.pattern, rule.section))
        fitting = [s.name for s in STYLES.values() if kind in s.module_kinds and not s.fits_any_module]
        yield Problem(
            loc=rule.loc,
            message=f"{name} is a {type(module).__name__} ({kind}); style {spec.name!r} applies to "
            f"{', '.join(sorted(map(str, spec.module_kinds)))} modules",
            fix=(
                f"styles for {kind} modules: {', '.join(fitting)}"
                if fitting
                else "point the rule at the Linear/Embedding submodules instead"
            ),
        )
