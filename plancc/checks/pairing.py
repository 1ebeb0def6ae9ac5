"""layout-pairing: a module that leaves its output sharded must feed one that accepts it.

Inside an attention or MLP block, colwise projections leave a feature-sharded local
tensor (Shard(-1)); the block's output projection must be rowwise (input Shard(-1)) to
reduce it. Under sequence parallelism the residual stream between blocks is a sequence
shard (Shard(1)); a projection reading it with a replicated-input style needs the shard
gathered first, by its block (``gather_seq_input`` on ``self_attn``/``mlp``) or by itself
(``colwise_seq``): a plain tensor carries no layout, and torch would silently treat the
shard as the whole sequence.

PASS  q/k/v_proj: colwise, o_proj: rowwise
FAIL  q/k/v_proj: colwise, o_proj left out -> o_proj gets heads/tp features, a shape error
FAIL  under SP: input_layernorm: sequence_parallel, q_proj: colwise, and self_attn not gathered
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterator

from torch.distributed.tensor import Replicate, Shard

from ..errors import Diagnostic
from ..styles import ModuleKind, canonical_style, layouts_of
from .context import CheckContext, kind_of

ID = "layout-pairing"

_FEATURES = Shard(-1)
_SEQUENCE = Shard(1)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _block(name: str) -> str:
    """'model.layers.3.self_attn.q_proj' -> 'model.layers.3' (the repeated decoder block)."""
    match = re.match(r"^(.*?\.\d+)(?:\.|$)", name)
    return match.group(1) if match else ""


def check(ctx: CheckContext) -> Iterator[Diagnostic]:
    if ctx.resolved is None or ctx.tp == 1:
        return
    modules = dict(ctx.model.named_modules())
    producers: dict[str, list[tuple[str, object]]] = defaultdict(list)
    consumers: dict[str, list[tuple[str, object]]] = defaultdict(list)
    seq_blocks: set[str] = set()
    replicated_readers: list[tuple[str, object]] = []
    for name, module, rule, lay in ctx.assigned():
        if lay.output == _FEATURES and lay.local_output:
            producers[_parent(name)].append((name, rule))
        if lay.input == _FEATURES and lay.weight is not None:
            consumers[_parent(name)].append((name, rule))
        if lay.output == _SEQUENCE and _block(name):
            seq_blocks.add(_block(name))
        if lay.input == Replicate() and lay.weight is not None and kind_of(module) is ModuleKind.LINEAR \
                and _block(name):
            replicated_readers.append((name, rule))
    reported: set[tuple[str, str]] = set()

    def once(rule, key) -> bool:
        token = (rule.pattern, key)
        if token in reported:
            return False
        reported.add(token)
        return True

    for parent, made in producers.items():
        if consumers.get(parent):
            continue
        name, rule = made[0]
        whole = [n for n, m in modules.items() if _parent(n) == parent and kind_of(m) is ModuleKind.LINEAR
                 and ctx.rule_for(n) is None]
        if not once(rule, "producer"):
            continue
        if not parent:  # a top-level module (lm_head): its output is the model's output
            yield Diagnostic(
                rule=ID,
                loc=rule.loc,
                message=f"{name} hands the model's output back as plain tensors sharded on features "
                "(shard(-1)): the loss would read one rank's slice of the vocabulary as if it were all of it",
                fix=f"make {name} colwise_logits (vocab-parallel logits that plancc's loss and log-probs "
                "combine), or colwise_rep to gather them",
            )
            continue
        yield Diagnostic(
            rule=ID,
            loc=rule.loc,
            message=f"{name} leaves its output sharded on features (shard(-1)) but no module of "
            f"{parent} accepts that layout"
            + (f"; {', '.join(w.rpartition('.')[2] for w in whole)} left whole" if whole else ""),
            fix=(f"add '{_glob(whole[0])}: rowwise'" if whole else
                 f"make {name.rpartition('.')[2]} colwise_rep to gather its output"),
        )
    for parent, used in consumers.items():
        if producers.get(parent):
            continue
        name, rule = used[0]
        if not once(rule, "consumer"):
            continue
        yield Diagnostic(
            rule=ID,
            loc=rule.loc,
            message=f"{name} expects feature-sharded input (shard(-1)) but no module of {parent} produces it",
            fix=f"make the projections feeding {name.rpartition('.')[2]} colwise, or use rowwise_rep",
        )
    if ctx.resolved.sequence_parallel:
        for name, rule in replicated_readers:
            if _block(name) in seq_blocks and not _gathered_above(ctx, name) and once(rule, "sequence"):
                yield Diagnostic(
                    rule=ID,
                    loc=rule.loc,
                    message=f"{name} reads the sequence-sharded residual stream of {_block(name)} "
                    f"but its style {rule.style.name!r} declares a replicated input",
                    fix=f"add '{_glob(_parent(name))}: gather_seq_input' to the sequence_parallel overlay",
                )


def _gathered_above(ctx: CheckContext, name: str) -> bool:
    """Whether an enclosing module inside the block gathers the sequence before ``name``."""
    block = _block(name)
    parent = _parent(name)
    while parent and parent != block:
        rule = ctx.rule_for(parent)
        if rule is not None:
            lay = layouts_of(canonical_style(rule.style.name).build(rule.style.overrides))
            if lay.input == _SEQUENCE and lay.output == Replicate():
                return True
        parent = _parent(parent)
    return False


def _glob(name: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
