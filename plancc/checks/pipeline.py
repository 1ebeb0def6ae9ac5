"""pipeline: a pipeline-parallel layout (``--pp``) that torch's schedules can run on this model.

With pp > 1 the plan's ``pipeline:`` section says the schedule, the microbatches a step, the
stages each rank holds and, optionally, the module globs of every stage (without it the decoder
layers split evenly, the first stages taking the remainder; ``layers_per_stage`` instead of
``virtual_stages_per_rank`` derives the stage count from the model's layers; without the section,
1F1B with one microbatch a rank). Checked before launch: the schedule runs that many stages a rank (V schedules
exactly two); there are at least as many decoder layers as stages; the stages' globs cover every
decoder layer once and in order, the embedding in the first stage and the final norm and lm_head
in the last; at least one microbatch per pipeline rank (fewer hang 1F1B: torchtitan#775); and
what the pipeline runtime does not run yet is refused with the reason. Context and expert
parallelism run inside stages (the ``context-parallel`` and ``expert-parallel`` rules check the
model for them as without pp), and a weight tied across stages is kept tied.

A stage glob's segment ``[a-b]`` of two numbers is the numeric range a..b (``model.layers.[0-13]``
is layers 0 to 13), not a character class.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.globs import ModuleTree, glob_problem
from ..compiler.plan import PipelineSpec
from ..compiler.stage_globs import decoder_layer_names, stage_glob_matches
from ..schedules import schedule_problem, stage_layers
from .context import CheckContext, Problem
from .example import Example

ID = "pipeline"

EXAMPLES = (
    Example(
        verdict="PASS",
        text="--pp 4 on qwen3-8b (36 layers) with 1f1b and 8 microbatches",
        edits=(("pipeline", None, {"schedule": "1f1b", "microbatches": 8}),),
        args={"pp": 4, "world_size": 8},
    ),
    Example(
        verdict="FAIL",
        text="--pp 4 with 2 microbatches: 1F1B waits for microbatches that never come",
        edits=(("pipeline", None, {"schedule": "1f1b", "microbatches": 2}),),
        args={"pp": 4, "world_size": 8},
    ),
)


def check(ctx: CheckContext) -> Iterator[Problem]:
    layout = ctx.layout
    if layout.pp == 1:
        return
    spec = ctx.plan.pipeline or PipelineSpec(loc=ctx.plan.loc)
    loc = spec.loc
    layers = _decoder_layers(ctx)
    try:
        virtual = spec.per_rank(len(layers), layout.pp)
    except ValueError as exc:  # layers_per_stage that makes no whole rounds, or not the schedule's
        yield Problem(
            loc=loc,
            message=str(exc),
            fix="a layers_per_stage that gives pp x the schedule's stages a rank, or virtual_stages_per_rank",
        )
        return
    why = schedule_problem(spec.schedule, virtual)
    if why is not None:
        yield Problem(loc=loc, message=why, fix="set virtual_stages_per_rank: 2 for zbv/dualpipev, 1 for gpipe/1f1b")
        return
    stages = layout.pp * virtual
    microbatches = spec.microbatches or layout.pp
    if microbatches < layout.pp:
        yield Problem(
            loc=loc,
            message=f"{microbatches} microbatches for pp={layout.pp}: a schedule needs at least one per pipeline "
            "rank (1F1B waits for microbatches that never come)",
            fix=f"microbatches: {layout.pp} or more",
        )
    elif spec.schedule == "dualpipev" and microbatches < 2 * layout.pp:
        yield Problem(
            loc=loc,
            message=f"{microbatches} microbatches for DualPipeV at pp={layout.pp}: its order needs two per "
            "pipeline rank (torch's deadlocks with fewer)",
            fix=f"microbatches: {2 * layout.pp} or more",
        )
    if spec.stages:
        yield from _stage_globs(ctx, spec, stages, layers)
    elif len(layers) < stages:
        yield Problem(
            loc=loc,
            message=f"{len(layers)} decoder layers for {stages} stages (pp={layout.pp} x {virtual} a rank): each "
            "stage needs at least one",
            fix=f"a pp whose stages are at most {len(layers)}",
        )
    elif spec.first_stage_less_layers or spec.last_stage_less_layers:
        try:
            stage_layers(len(layers), stages, spec.first_stage_less_layers, spec.last_stage_less_layers)
        except ValueError as exc:
            yield Problem(
                loc=loc,
                message=str(exc),
                fix="smaller first_stage_less_layers / last_stage_less_layers, or fewer stages",
            )


def _decoder_layers(ctx: CheckContext) -> list[str]:
    return decoder_layer_names(ctx.modules)


def _stage_globs(ctx: CheckContext, spec: PipelineSpec, stages: int, layers: list[str]) -> Iterator[Problem]:
    if len(spec.stages) != stages:
        yield Problem(
            loc=spec.loc,
            message=f"{len(spec.stages)} stages listed for pp={ctx.layout.pp} x {stages // ctx.layout.pp} a "
            f"rank = {stages}",
            fix=f"list {stages} stages, or drop 'stages' to split the layers evenly",
        )
        return
    tree = ModuleTree(ctx.modules)
    position = {name: i for i, name in enumerate(layers)}
    owner: dict[str, int] = {}
    last_seen = -1
    for stage, (globs, loc) in enumerate(zip(spec.stages, spec.stage_locs, strict=True)):
        names: list[str] = []
        for pattern in globs:
            why, found = glob_problem(pattern), stage_glob_matches(tree, pattern)
            if why is not None or not found:
                shapes = ", ".join(tree.suggest(pattern)) or "model.layers.[0-13]"
                yield Problem(
                    loc=loc,
                    message=f"stage {stage}'s glob {pattern!r} " + (why or "matches no module of this model"),
                    fix=f"a module glob, e.g. {shapes}",
                )
            names += found
        mine = sorted({position[n] for n in names if n in position})
        for index in mine:
            if layers[index] in owner:
                yield Problem(
                    loc=loc,
                    message=f"{layers[index]} is in stage {owner[layers[index]]} and stage {stage}",
                    fix="every decoder layer in one stage",
                )
            owner[layers[index]] = stage
        if mine and mine[0] < last_seen:
            yield Problem(
                loc=loc,
                message=f"stage {stage} starts at {layers[mine[0]]}, before the layers of the stage before it",
                fix="list the stages in the order of their layers",
            )
        last_seen = max([last_seen, *mine])
        for name in names:
            tail = name.rsplit(".", 1)[-1]
            if tail == "embed_tokens" and stage != 0:
                yield Problem(loc=loc, message=f"{name} in stage {stage}", fix="the embedding goes in the first stage")
            if tail in ("norm", "lm_head") and name not in position and stage != stages - 1 and "layers" not in name:
                yield Problem(loc=loc, message=f"{name} in stage {stage}", fix=f"{tail} goes in the last stage")
    missing = [name for name in layers if name not in owner]
    if missing:
        yield Problem(
            loc=spec.loc,
            message=f"{len(missing)} decoder layers in no stage, the first {missing[0]}",
            fix="every decoder layer in one stage (a segment [a-b] is the range of layers a..b)",
        )
