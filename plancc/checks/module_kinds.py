"""style-module-kind: a style must fit the module it is applied to."""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.styles import STYLES, canonical_style
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
    for name, module, rule, _ in ctx.assigned():
        spec = canonical_style(rule.style.name)
        kind = kind_of(module)
        if kind in spec.module_kinds or (rule.pattern, rule.section) in reported:
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
