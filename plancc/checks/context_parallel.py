"""context-parallel: combinations the CP attention does not support.

Under context parallelism every module sees only its rank's shard of the sequence. Attention
is exact because the CP attention gathers the keys and values; linear-attention and
state-space layers (Qwen3-Next, Qwen3.5, Kimi-Linear, Nemotron-H, Granite hybrid, Jamba,
MiniMax's lightning attention, ...) because they trade sequence shards for blocks of heads
(``runtime.cp_mixers``), which needs their heads (and channels) divisible by cp; every other
module must work position by position. Layers that pick their keys from the keys' activations
-- DeepSeek sparse attention's indexer, Doge's dynamic mask -- are handed every rank's keys
(``runtime.cp_key_selection``) and attend under a dense ``[S/cp, S]`` mask, which a warning
states. A layer that mixes positions some other way -- a recurrence in code plancc does not
know, an indexer or a dynamic mask in a form plancc does not know -- would compute on its shard
alone, so cp > 1 is refused for such a model. (Whether the length shards evenly is
``sequence-length``'s.)

This rule reads the layout's cp alone: ``plancc suggest`` walks the model for it once per cp
size, not once per layout (``checks.layout_memo``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from torch import nn

from ..compiler.plain_placements import Shard
from ..errors import Severity
from ..sequence_mixing import CP_KERNELS, calls_attention_interface, is_cp_attention, sequence_mixing, shards_by_heads
from .context import CheckContext, Problem, text_config
from .example import Example

ID = "context-parallel"


EXAMPLES = (
    Example(verdict="PASS", text="--cp 2 on Qwen3 (every layer's sequence mixing is its attention)", args={"cp": 2}),
    Example(
        verdict="PASS",
        text="--cp 2 on a model with attention logit soft-capping (its blocks run a tiled soft-capped kernel)",
        plan="gemma3.yaml",
        model="gemma-3-1b",
        config={"attn_logit_softcapping": 50.0},
        args={"cp": 2},
    ),
    Example(
        verdict="WARN",
        text="--cp 2 on Doge (its dynamic mask picks keys per query: a dense [S/cp, S] mask per layer)",
        model="tiny-doge",
        args={"cp": 2},
    ),
)

# What in a config says its layers pick keys per query from the keys' activations.
_KEY_SELECTION = {
    "index_topk": "a sparse-attention indexer keeps each query's top {} keys",
    "keep_window_size": "a dynamic mask keeps each query's {} best keys",
}


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.layout.cp == 1:
        return
    cfg = text_config(ctx.config)
    for field, what in _KEY_SELECTION.items():
        if isinstance(getattr(cfg, field, None), int):
            yield Problem(
                loc=ctx.plan.loc,
                message=f"under context parallelism {what.format(getattr(cfg, field))} over the whole sequence: "
                "its layers are handed every rank's keys and attend under a dense [S/cp, S] mask (a cp-th of "
                "the unsharded layer's S x S), not the block attention whose memory is linear in S",
                fix="nothing to change for exactness; at long lengths count S*S/cp mask elements per layer",
                severity=Severity.WARNING,
            )
    attention = [m for m in ctx.model.modules() if is_cp_attention(m)]
    mixers = [(name, m) for name, m in ctx.model.named_modules() if shards_by_heads(m)]
    yield from _head_counts(ctx, mixers)
    mixer = next(_sequence_mixers(ctx.model), None)
    if (attention or mixers) and mixer is not None:
        name, why = mixer
        yield Problem(
            loc=ctx.plan.loc,
            message=f"context parallelism is not supported for {type(ctx.model).__name__}: {name} {why}, which "
            "would see only its rank's shard of the sequence (the CP attention gathers keys and values, the "
            "linear-attention and state-space kernels trade shards for heads; nothing else is sharded)",
            fix="use --cp 1 for this model (tensor and data parallelism still apply)",
        )
    if not attention and not mixers:
        yield Problem(
            loc=ctx.plan.loc,
            message=f"context parallelism is not supported for {type(ctx.model).__name__}: it has no attention "
            "modules that call transformers' attention interface, which the CP attention replaces",
            fix="use --cp 1 for this model",
        )


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder's layers: the children of its ``layers`` module list."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(module):
            return [(f"{name}.{child}", layer) for child, layer in module.named_children()]
    return []


def _sequence_mixers(model: nn.Module) -> Iterator[tuple[str, str]]:
    """(module name, what it does) for each module of the decoder's layers that mixes positions
    in a way the CP attention does not shard."""
    for layer_name, layer in _decoder_layers(model):
        mixers = [name for name, m in layer.named_modules(prefix=layer_name) if shards_by_heads(m)]
        verdicts = [calls_attention_interface(m) for m in layer.modules()]
        if None not in verdicts and not any(verdicts) and not mixers and _mixes_positions(layer):
            kind = type(layer).__name__
            yield (
                layer_name,
                f"({kind}) has no attention that calls transformers' attention interface (a "
                "linear-attention or state-space layer) and mixes the sequence in its own code, not through "
                f"a kernel context parallelism shards by heads ({', '.join(CP_KERNELS[:-1])})",
            )
        for name, module in layer.named_modules(prefix=layer_name):
            if any(name.startswith(f"{m}.") for m in mixers):
                continue  # a mixer's convolution runs through its cp kernel
            how = sequence_mixing(module)
            if how is not None:
                yield name, how


# Class names of the modules that mix positions (an MLP-only block -- Nemotron-H's "-" and "E"
# layers -- has none and works token by token under any cp).
_MIXER_NAMES = re.compile(r"Attention|Mixer|Mamba|SSM|Delta|Conv|Recurren|Lightning|Retention")


def _mixes_positions(layer: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv1d) or _MIXER_NAMES.search(type(m).__name__) for m in layer.modules())


# What a cp mixer splits over the cp ranks, by the attribute transformers' mixers keep it in.
_SPLIT = {
    "num_k_heads": "key heads",
    "num_v_heads": "value heads",
    "num_heads": "heads",
    "num_attention_heads": "heads",
    "intermediate_size": "channels",
}


def _tp_sharded(ctx: CheckContext) -> set[str]:
    """Modules whose output the plan leaves sharded over tp (colwise without gathering it)."""
    return {name for name, _, _, lay in ctx.assigned() if isinstance(lay.output, Shard)}


def _head_counts(ctx: CheckContext, mixers: list[tuple[str, nn.Module]]) -> Iterator[Problem]:
    """A cp mixer runs ``1/cp`` of its heads (and convolution channels) on every rank -- of the
    heads its tp rank holds: transformers' plans gather the mixers' projections (every tp rank
    runs all heads), a plan that leaves them sharded over tp gives it ``1/tp`` of them."""
    cp, seen, sharded = ctx.layout.cp, set(), _tp_sharded(ctx)
    for name, module in mixers:
        if type(module) in seen:
            continue  # every layer of a kind has the same counts
        seen.add(type(module))
        over_tp = ctx.tp > 1 and any(other.startswith(f"{name}.") for other in sharded)
        split = cp * ctx.tp if over_tp else cp  # the heads split over tp first
        counts = {
            what: getattr(module, attr) for attr, what in _SPLIT.items() if isinstance(getattr(module, attr, None), int)
        }
        if "heads" in counts:  # Mamba's channels are its heads' (Mamba2): the heads decide
            counts.pop("channels", None)
        conv = next((c for c in module.children() if isinstance(c, nn.Conv1d)), None)
        if conv is not None:
            counts["convolution channels"] = conv.in_channels
        groups = getattr(module, "n_groups", None)
        for what, n in counts.items():
            if n % split:
                yield _not_divisible(ctx, name, module, f"{n} {what}", n, split)
        if isinstance(groups, int) and groups % split and split % groups:
            yield _not_divisible(
                ctx,
                name,
                module,
                f"{groups} head groups (it neither divides them nor is a multiple of them)",
                groups,
                split,
            )


def _not_divisible(ctx: CheckContext, name: str, module: nn.Module, found: str, n: int, split: int) -> Problem:
    over_tp = split != ctx.layout.cp
    allowed = [d for d in range(1, n + 1) if n % (d * (ctx.tp if over_tp else 1)) == 0]
    what = f"tp x cp={split}" if over_tp else f"cp={split}"
    return Problem(
        loc=ctx.plan.loc,
        message=f"{what} does not divide {name} ({type(module).__name__})'s {found}: under context "
        "parallelism each rank runs its block of them over the whole sequence",
        fix=f"use --cp in {{{', '.join(map(str, allowed))}}}",
    )
