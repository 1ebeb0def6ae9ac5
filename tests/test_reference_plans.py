"""The shipped plans' TP-only compilation equals the reference design's hand-written TP plans
(NeMo-RL ``parallelize.py``), module for module: style class, input/output layouts and the
local-output flag. Where the reference is wrong (Qwen3/Gemma3 q_norm/k_norm left out, so
their gradients are computed from one rank's heads only), plancc goes further: those are the
only extra modules, and they get a style whose gradients are summed over tp. Where the
reference gives up (Gemma3's tied embedding and lm_head, left whole), plancc shards them
vocab-parallel exactly as it does Qwen's and Llama's.

The reference also leaves every projection to wrap its own input, so each all-reduces its input
gradient; plancc styles the attention and MLP blocks (``shared_input``) so that the
projections' gradients are summed first and all-reduced once per block (tests/test_communication.py
counts it). Those blocks are the other modules beyond the reference.

The expectations below are the reference's semantics written as data (not its code).
"""

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import plancc
from plancc.runtime.styles.block_input import GatherSequenceInput, SharedInput
from plancc.models import build_meta_model

from .conftest import PLANS

COL = (ColwiseParallel, Replicate(), Shard(-1), True)
ROW = (RowwiseParallel, Shard(-1), Replicate(), True)
EMBED = (RowwiseParallel, Replicate(), Replicate(), True)
LM_HEAD = (ColwiseParallel, Replicate(), Shard(-1), False)

PROJECTIONS = {
    "model.layers.*.self_attn.q_proj": COL,
    "model.layers.*.self_attn.k_proj": COL,
    "model.layers.*.self_attn.v_proj": COL,
    "model.layers.*.self_attn.o_proj": ROW,
    "model.layers.*.mlp.up_proj": COL,
    "model.layers.*.mlp.gate_proj": COL,
    "model.layers.*.mlp.down_proj": ROW,
}
REFERENCE_TP = {
    # _parallelize_qwen (TP branch) and _parallelize_llama: projections + vocab-parallel ends
    "qwen": {**PROJECTIONS, "model.embed_tokens": EMBED, "lm_head": LM_HEAD},
    "llama": {**PROJECTIONS, "model.embed_tokens": EMBED, "lm_head": LM_HEAD},
    # _parallelize_gemma3: projections only (embedding and lm_head are tied and left whole)
    "gemma3": dict(PROJECTIONS),
}
QK_NORMS = {"model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"}
BLOCKS = {"model.layers.*.self_attn", "model.layers.*.mlp"}

CASES = [
    ("qwen3.yaml", "tiny-qwen3", "qwen", QK_NORMS),
    ("qwen3.yaml", "qwen3-8b", "qwen", QK_NORMS),
    ("qwen3.yaml", "tiny-qwen2", "qwen", set()),
    ("qwen3.yaml", "qwen2.5-7b", "qwen", set()),
    ("llama.yaml", "tiny-llama", "llama", set()),
    ("llama.yaml", "llama-3.1-8b", "llama", set()),
    ("gemma3.yaml", "tiny-gemma3", "gemma3", QK_NORMS),
    ("gemma3.yaml", "gemma-3-1b", "gemma3", QK_NORMS),
]


def signature(style):
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return (type(style), style.input_layouts[0], style.output_layouts[0], style.use_local_output)
    return (type(style),)


def expand(model, table):
    from plancc.compiler.resolve import glob_matches

    names = [n for n, _ in model.named_modules() if n]
    return {n: sig for pattern, sig in table.items() for n in names if glob_matches(pattern, n)}


@pytest.mark.parametrize("plan_file,preset,family,extra", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_tp_plan_equals_reference(plan_file, preset, family, extra):
    model = build_meta_model(preset)
    compiled = plancc.compile_plan(plancc.load_plan(PLANS / plan_file), model, tp_size=2)
    expected = expand(model, REFERENCE_TP[family])
    ours = {name: signature(style) for name, style in compiled.items() if name in expected}
    assert ours == expected
    # Beyond the reference: only modules it got wrong or kept whole on purpose.
    beyond = set(compiled) - set(expected)
    blocks = set(expand(model, dict.fromkeys(BLOCKS, None)))
    beyond_globs = {n for n in beyond if not n.endswith(("embed_tokens", "lm_head"))} - blocks
    assert beyond_globs == set(expand(model, dict.fromkeys(extra, None)))
    for name in beyond_globs:  # q_norm/k_norm: replicated weight, head-sharded input
        style = compiled[name]
        assert isinstance(style, SequenceParallel) and style.sequence_sharding == (Shard(2),)
    for name in blocks:  # the block's input handed to its projections as one replicated DTensor
        style = compiled[name]
        assert isinstance(style, SharedInput) and style.use_local_output is False


def test_gemma3_shards_its_tied_embedding_and_lm_head_where_the_reference_keeps_them_whole():
    model = build_meta_model("tiny-gemma3")
    assert model.config.tie_word_embeddings
    compiled = plancc.compile_plan(plancc.load_plan(PLANS / "gemma3.yaml"), model, tp_size=2)
    assert signature(compiled["model.embed_tokens"]) == EMBED  # same styles as Qwen's / Llama's ends
    assert signature(compiled["lm_head"]) == LM_HEAD


@pytest.mark.parametrize("plan_file,preset", [("qwen3.yaml", "tiny-qwen3"), ("llama.yaml", "tiny-llama"),
                                              ("gemma3.yaml", "tiny-gemma3")])
def test_sp_overlay_keeps_activations_local_between_modules(plan_file, preset):
    """transformers 5.x adds module outputs to plain tensors (residuals, rotary cos/sin): under
    SP every style hands back a local tensor except the logits and the block inputs, which only
    the block's own projections read (the dtensor-output check holds them to that)."""
    model = build_meta_model(preset)
    compiled = plancc.compile_plan(plancc.load_plan(PLANS / plan_file), model, tp_size=2, sequence_parallel=True)
    dtensor_outputs = {n for n, s in compiled.items() if getattr(s, "use_local_output", True) is False}
    assert dtensor_outputs - {"lm_head"} == set(expand(model, dict.fromkeys(BLOCKS, None)))
    assert all(isinstance(compiled[n], GatherSequenceInput) for n in dtensor_outputs - {"lm_head"})


def test_tp_size_one_compiles_to_nothing_but_still_resolves(write_plan):
    model = build_meta_model("tiny-qwen3")
    assert plancc.compile_plan(plancc.load_plan(PLANS / "qwen3.yaml"), model, tp_size=1) == {}
    typo = write_plan("plancc: 1\nname: t\narchitectures: [Qwen3ForCausalLM]\n"
                      "tensor_parallel:\n  model.layers.*.mlp.up_prj: colwise\n")
    with pytest.raises(plancc.PlanError) as info:
        plancc.compile_plan(plancc.load_plan(typo), model, tp_size=1)
    assert [(d.rule, d.line) for d in info.value.diagnostics] == [("glob-no-match", 5)]
