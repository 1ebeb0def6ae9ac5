"""The style vocabulary: every name lowers to a torch ParallelStyle with the placements the
table documents, overrides land where they should, and the schema knows exactly these names."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from plancc.compiler.plain_placements import Replicate, Shard
from plancc.compiler.plan import parse_plan
from plancc.compiler.schema import plan_schema
from plancc.compiler.styles import ALIASES, STYLE_NAMES, STYLES, canonical_style, default_layouts, style_layouts
from plancc.runtime.styles import torch_style
from plancc.runtime.styles.attention import LatentKeyValueProjection, PerHeadParameters
from plancc.runtime.styles.basic import LeaveWhole, RotaryUnderSequenceParallel
from plancc.runtime.styles.block_input import GatherSequenceInput, SharedInput
from plancc.runtime.styles.experts import ExpertsOverTensorParallel
from plancc.runtime.styles.packed import PackedColwise, PackedRowwise

from .style_oracle import layouts_of

R, S1, S2, SL = Replicate(), Shard(1), Shard(2), Shard(-1)

# name -> (torch class, input, output, local output). Written independently of the table
# in plancc/styles.py: this is the documentation the code must keep matching.
DOCUMENTED = {
    "colwise": (ColwiseParallel, R, SL, True),
    "colwise_rep": (ColwiseParallel, R, R, True),
    "colwise_seq": (ColwiseParallel, S1, SL, True),
    "colwise_logits": (ColwiseParallel, R, SL, False),
    "colwise_logits_seq": (ColwiseParallel, S1, SL, False),
    "rowwise": (RowwiseParallel, SL, R, True),
    "rowwise_rep": (RowwiseParallel, R, R, True),
    "rowwise_seq": (RowwiseParallel, SL, S1, True),
    # the output each rank's 1/tp of every block; declared as colwise's, regrouped by all-to-all
    "packed_colwise": (PackedColwise, R, SL, True),
    "packed_rowwise": (PackedRowwise, SL, R, True),
    "embedding_rowwise": (RowwiseParallel, R, R, True),
    "embedding_seq": (RowwiseParallel, R, S1, True),
    "sequence_parallel": (SequenceParallel, S1, S1, True),
    "qk_norm": (SequenceParallel, S2, S2, True),
    "shard_seq_output": (PrepareModuleOutput, R, S1, True),
    "gather_seq_input": (GatherSequenceInput, S1, R, False),  # one DTensor for the block's projections
    "shared_input": (SharedInput, R, R, False),
    "prepare_input": (PrepareModuleInput, R, R, True),
    "prepare_output": (PrepareModuleOutput, R, R, True),
    "prepare_input_output": (PrepareModuleInputOutput, R, R, True),
    "rotary_sp": (RotaryUnderSequenceParallel, S1, R, True),  # hidden (for its dtype) a shard; cos/sin whole
    "replicate": (LeaveWhole, None, None, None),
    "moe_experts": (ExpertsOverTensorParallel, R, R, True),
    "mla_kv_a_proj": (LatentKeyValueProjection, R, R, True),
    "per_head_params": (PerHeadParameters, R, R, True),
}
HF_ALIASES = {
    "colwise_gather_output": "colwise_rep",
    "rowwise_split_input": "rowwise_rep",
    "replicated_with_grad_allreduce": "qk_norm",
    "local_params": "per_head_params",
}


def test_vocabulary_is_exactly_the_documented_one():
    assert set(STYLES) == set(DOCUMENTED)
    assert ALIASES == HF_ALIASES


@given(st.sampled_from(STYLE_NAMES))
def test_every_style_name_lowers_to_its_documented_layouts(name):
    style = torch_style(canonical_style(name).declare())
    assert isinstance(style, ParallelStyle)
    cls, inp, out, local = DOCUMENTED[ALIASES.get(name, name)]
    lay = layouts_of(style)
    assert type(style) is cls
    assert (lay.input, lay.output, lay.local_output) == (inp, out, local)
    assert default_layouts(name) == lay  # the table's own placements, read without building torch objects


layouts = st.one_of(st.just("replicate"), st.integers(-3, 3).map(lambda d: f"shard({d})"))


# keyword layouts come in pairs and prepare_input_output nests two torch styles: both have their
# own test below (test_torchs_prepare_module_input_forms_are_expressible)
KEYWORD_KEYS = {"input_kwarg_layouts", "desired_input_kwarg_layouts"}
ONE_LAYOUT_STYLES = sorted(n for n in STYLES if STYLES[n].overridable and n != "prepare_input_output")


@given(name=st.sampled_from(ONE_LAYOUT_STYLES), data=st.data())
def test_mapping_form_overrides_reach_the_torch_style(name, data):
    spec = STYLES[name]
    keys = data.draw(st.sets(st.sampled_from(sorted(spec.overridable - KEYWORD_KEYS)), min_size=1))
    kinds = {"use_local_output": st.booleans(), "rope_dim": st.integers(1, 512), "blocks": st.integers(2, 8)}
    values = {k: data.draw(kinds.get(k, layouts)) for k in keys}
    body = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())
    plan = parse_plan(f"plancc: 1\nname: p\narchitectures: [A]\ntensor_parallel:\n  x: {{style: {name}, {body}}}\n")
    (rule,) = plan.tensor_parallel
    style = torch_style(spec.declare(rule.style.overrides))
    # what the checks read from the table alone is what the built torch style does
    assert style_layouts(rule.style) == layouts_of(style)
    for key, value in values.items():
        got = getattr(style, key)
        got = got[0] if isinstance(got, tuple) else got
        if isinstance(value, (bool, int)):
            assert got is value or got == value
        elif value == "replicate":
            assert type(got).__name__ == "Replicate"  # torch's placement, on the built style
        else:
            assert type(got).__name__ == "Shard" and got.dim == int(value[6:-1])


def test_schema_enum_is_the_style_table():
    assert plan_schema()["$defs"]["style_name"]["enum"] == list(STYLE_NAMES)


@pytest.mark.parametrize("alias,name", sorted(HF_ALIASES.items()))
def test_hf_alias_is_accepted_and_canonicalized(alias, name):
    plan = parse_plan(f"plancc: 1\nname: p\narchitectures: [A]\ntensor_parallel:\n  x: {alias}\n")
    assert plan.tensor_parallel[0].style.name == name
    assert plan.tensor_parallel[0].style.written_as == alias


def test_plancc_styles_lists_every_style_with_placements(cli):
    code, out, _ = cli("styles")
    assert code == 0
    for name in STYLES:
        assert name in out
    assert "shard(-1)" in out and "linear:shard(0)" in out


def test_every_transformers_tp_plan_style_is_taken_or_refused_with_a_reason():
    """A new style in the pinned transformers fails here until it is mapped or explained."""
    import importlib
    import pkgutil

    import transformers.distributed
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    # modules register styles when imported (expert_parallel adds the MoE ones): import them
    # all, so the registry does not depend on what other tests imported first
    for mod in pkgutil.iter_modules(transformers.distributed.__path__):
        importlib.import_module(f"transformers.distributed.{mod.name}")

    from plancc.compiler.styles import HF_UNSUPPORTED, STYLE_NAMES

    hf_names = set(ALL_PARALLEL_STYLES.valid_keys())
    assert hf_names, "transformers registered no TP styles"
    assert hf_names - set(STYLE_NAMES) - set(HF_UNSUPPORTED) == set()
    assert not set(HF_UNSUPPORTED) & set(STYLE_NAMES)


def _torch_attrs(style):
    """A built torch prepare style's layouts as plain values, by attribute (nested ones for
    PrepareModuleInputOutput), for comparison with torch's own class built directly."""
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput as Both

    parts = [style.prepare_module_input, style.prepare_module_output] if isinstance(style, Both) else [style]
    names = ("input_layouts", "desired_input_layouts", "input_kwarg_layouts", "desired_input_kwarg_layouts",
             "output_layouts", "desired_output_layouts", "use_local_output", "use_local_input", "with_kwargs")
    return [{n: repr(getattr(part, n)) for n in names if hasattr(part, n)} for part in parts]


@pytest.mark.parametrize(("written", "torch_built"), [
    ("{style: prepare_input, input_layouts: [shard(0), null], desired_input_layouts: [replicate, null]}",
     lambda T: PrepareModuleInput(input_layouts=(T.Shard(0), None), desired_input_layouts=(T.Replicate(), None),
                                  use_local_output=True)),
    ("{style: prepare_input, input_kwarg_layouts: {freqs: shard(0)}, desired_input_kwarg_layouts: {freqs: replicate}}",
     lambda T: PrepareModuleInput(input_kwarg_layouts={"freqs": T.Shard(0)},
                                  desired_input_kwarg_layouts={"freqs": T.Replicate()}, use_local_output=True)),
    ("{style: prepare_input, input_layouts: [shard(1)], desired_input_layouts: [replicate], "
     "input_kwarg_layouts: {mask: replicate}, desired_input_kwarg_layouts: {mask: replicate}}",
     lambda T: PrepareModuleInput(input_layouts=(T.Shard(1),), desired_input_layouts=(T.Replicate(),),
                                  input_kwarg_layouts={"mask": T.Replicate()},
                                  desired_input_kwarg_layouts={"mask": T.Replicate()}, use_local_output=True)),
    ("{style: prepare_input_output, input_layouts: shard(0), desired_input_layouts: replicate, "
     "output_layouts: replicate, desired_output_layouts: shard(0)}",
     lambda T: PrepareModuleInputOutput(input_layouts=T.Shard(0), desired_input_layouts=T.Replicate(),
                                        use_local_input=True, output_layouts=T.Replicate(),
                                        desired_output_layouts=T.Shard(0), use_local_output=True)),
])
def test_torchs_prepare_module_input_forms_are_expressible(written, torch_built):
    """What torch's own tests write (test_parallelize_api, test_tp_style): one layout per
    positional input with None for one left alone, keyword inputs, PrepareModuleInputOutput.
    The style plancc builds from the plan equals torch's class built directly, and what the
    checks read (the first positional input, the output) is what torch's style does."""
    import torch.distributed.tensor as T

    plan = parse_plan(f"plancc: 1\nname: p\narchitectures: [A]\ntensor_parallel:\n  x: {written}\n")
    (rule,) = plan.tensor_parallel
    built = torch_style(STYLES[rule.style.name].declare(rule.style.overrides))
    expected = torch_built(T)
    assert type(built) is type(expected)
    assert _torch_attrs(built) == _torch_attrs(expected)
    assert style_layouts(rule.style) == layouts_of(built)


@pytest.mark.parametrize("written", [
    "{style: prepare_input, input_layouts: [shard(0), null], desired_input_layouts: replicate}",
    "{style: prepare_input, input_kwarg_layouts: {a: shard(0)}, desired_input_kwarg_layouts: {b: replicate}}",
])
def test_prepare_input_layouts_torch_would_refuse_are_a_style_override_diagnostic(written):
    from plancc.errors import PlanError

    with pytest.raises(PlanError) as info:
        parse_plan(f"plancc: 1\nname: p\narchitectures: [A]\ntensor_parallel:\n  x: {written}\n")
    assert [d.rule for d in info.value.diagnostics] == ["style-override"]
