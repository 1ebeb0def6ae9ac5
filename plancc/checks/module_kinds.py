"""style-module-kind: a style must fit the module it is applied to.

PASS  model.layers.*.mlp.up_proj (Linear): colwise
FAIL  model.layers.*.mlp (Qwen3MLP): colwise -> torch would raise NotImplementedError at run time
FAIL  model.norm (RMSNorm): rotary_sp
"""

from __future__ import annotations

from typing import Iterator

from ..errors import Diagnostic
from ..styles import STYLES, canonical_style
from .context import CheckContext, kind_of

ID = "style-module-kind"


def check(ctx: CheckContext) -> Iterator[Diagnostic]:
    reported: set[tuple[str, str]] = set()
    for name, module, rule, _ in ctx.assigned():
        spec = canonical_style(rule.style.name)
        kind = kind_of(module)
        if kind in spec.module_kinds or (rule.pattern, rule.section) in reported:
            continue
        reported.add((rule.pattern, rule.section))
        fitting = [s.name for s in STYLES.values() if kind in s.module_kinds and len(s.module_kinds) < 5]
        yield Diagnostic(
            rule=ID,
            loc=rule.loc,
            message=f"{name} is a {type(module).__name__} ({kind}); style {spec.name!r} applies to "
            f"{', '.join(sorted(map(str, spec.module_kinds)))} modules",
            fix=(f"styles for {kind} modules: {', '.join(fitting)}" if fitting else
                 "point the rule at the Linear/Embedding submodules instead"),
        )
