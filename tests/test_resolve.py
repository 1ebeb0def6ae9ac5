"""Globs bind to concrete module names; misses and conflicts are errors with locations."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import plancc
from plancc.compiler.resolve import glob_matches, glob_problem, resolve_plan
from plancc.models import build_meta_model

from .conftest import PLANS

PLANS_QWEN3 = PLANS / "qwen3.yaml"

HEAD = "plancc: 1\nname: t\narchitectures: [Qwen3ForCausalLM]\n"


@pytest.fixture(scope="module")
def tiny():
    return build_meta_model("tiny-qwen3")


@pytest.mark.parametrize("pattern,name,hit", [
    ("model.layers.*.mlp", "model.layers.0.mlp", True),
    ("model.layers.*.mlp", "model.layers.0.mlp.up_proj", False),
    ("model.*", "model.layers.0", False),  # '*' never crosses a dot
    ("model.**.up_proj", "model.layers.11.mlp.up_proj", True),
    ("**.q_norm", "model.layers.1.self_attn.q_norm", True),
    ("model.layers.[01].mlp", "model.layers.1.mlp", True),
    ("model.layers.[01].mlp", "model.layers.2.mlp", False),
    ("lm_head", "lm_head", True),
])
def test_glob_semantics(pattern, name, hit):
    assert glob_matches(pattern, name) is hit


@given(st.lists(st.from_regex(r"[a-z_]{1,6}|[0-9]{1,2}", fullmatch=True), min_size=1, max_size=6))
def test_a_name_matches_itself_and_its_star_generalization(segments):
    name = ".".join(segments)
    assert glob_matches(name, name)
    assert glob_matches(".".join("*" for _ in segments), name)
    assert glob_matches("**", name)


@pytest.mark.parametrize("pattern", ["a..b", "a.[b", "a.b**", ".a"])
def test_malformed_globs_are_named(pattern):
    assert glob_problem(pattern)


def test_typo_reports_closest_module_names(write_plan, tiny):
    plan = plancc.load_plan(write_plan(HEAD + "tensor_parallel:\n  model.layers.*.self_attn.q_prj: colwise\n"))
    with pytest.raises(plancc.PlanError) as info:
        resolve_plan(plan, tiny)
    (d,) = info.value.diagnostics
    assert (d.rule, d.line, d.column) == ("glob-no-match", 5, 3)
    assert "model.layers.*.self_attn.q_proj" in d.message


def test_optional_rule_matching_nothing_is_silent(write_plan):
    plan = plancc.load_plan(PLANS_QWEN3)
    resolved = resolve_plan(plan, build_meta_model("tiny-qwen2"))
    q_norm = [r for r in resolved.rules if r.rule.pattern.endswith("q_norm")]
    assert q_norm and q_norm[0].modules == ()


def test_two_rules_claiming_one_module_conflict(write_plan, tiny):
    plan = plancc.load_plan(write_plan(HEAD + "tensor_parallel:\n  model.layers.*.mlp.up_proj: colwise\n"
                                       "  model.**.up_proj: rowwise\n"))
    with pytest.raises(plancc.PlanError) as info:
        resolve_plan(plan, tiny)
    assert {(d.rule, d.line) for d in info.value.diagnostics} == {("rule-conflict", 6)}


def test_sp_overlay_overrides_tp_without_conflict(tiny):
    plan = plancc.load_plan(PLANS / "qwen3.yaml")
    tp = resolve_plan(plan, tiny)
    sp = resolve_plan(plan, tiny, sequence_parallel=True)
    assert tp.assignments["model.layers.0.self_attn.o_proj"].style.name == "rowwise"
    assert sp.assignments["model.layers.0.self_attn.o_proj"].style.name == "rowwise_seq"
    assert sp.assignments["model.layers.0.self_attn.q_norm"].style.name == "qk_norm"  # kept from TP
    assert "model.norm" not in tp.assignments and "model.norm" in sp.assignments


def test_fsdp_units_and_checkpointing_targets_resolve(write_plan, tiny):
    plan = plancc.load_plan(write_plan(HEAD + "tensor_parallel: {}\nfsdp: {units: [model.layers.*]}\n"
                                       "activation_checkpointing: [model.layers.*.mlpp]\n"))
    with pytest.raises(plancc.PlanError) as info:
        resolve_plan(plan, tiny)
    assert [(d.rule, d.line) for d in info.value.diagnostics] == [("glob-no-match", 6)]



def test_nested_fsdp_units_are_wrapped_inner_first_and_otherwise_as_written(write_plan, tiny):
    plan = plancc.load_plan(write_plan(HEAD + "tensor_parallel: {}\n"
                                       "fsdp: {units: [model.embed_tokens, model.layers.*, model.layers.*.mlp]}\n"))
    assert resolve_plan(plan, tiny).fsdp_units == (
        "model.embed_tokens", "model.layers.0.mlp", "model.layers.0", "model.layers.1.mlp", "model.layers.1")


def _reference_match(pattern: tuple[str, ...], name: tuple[str, ...]) -> bool:
    """The glob semantics written out directly: the specification the tree walk must meet."""
    from fnmatch import fnmatchcase

    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_reference_match(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatchcase(name[0], head) and _reference_match(rest, name[1:])


_segments = st.sampled_from(["model", "layers", "0", "1", "12", "mlp", "up_proj", "self_attn", "q_proj", "norm"])
_glob_segments = st.one_of(_segments, st.sampled_from(["*", "**", "?", "1*", "*_proj", "[01]", "q_*"]))


@settings(max_examples=150, deadline=None)
@given(names=st.lists(st.lists(_segments, min_size=1, max_size=5).map(".".join), min_size=1, max_size=30,
                      unique=True),
       pattern=st.lists(_glob_segments, min_size=1, max_size=6).map(".".join))
def test_tree_matching_equals_the_glob_specification_in_module_order(names, pattern):
    from plancc.compiler.globs import ModuleTree

    # parents before children, as named_modules() lists them
    ordered = sorted({".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)},
                     key=lambda n: (n.split("."),))
    want = tuple(n for n in ordered if _reference_match(tuple(pattern.split(".")), tuple(n.split("."))))
    assert ModuleTree(ordered).match(pattern) == want


def test_a_unit_whose_weight_has_a_user_outside_it_is_left_to_the_root():
    """Tied embeddings: the input embedding's weight is also the lm_head's. As a unit of its
    own it would be resharded before the lm_head reads it; the shipped plans name it anyway,
    so that untied variants free its gathered copy during the decoder."""
    from plancc.compiler.resolve import units_without_outside_users

    units = ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    untied, tied = build_meta_model("tiny-qwen3"), build_meta_model("tiny-gemma3")
    assert tied.model.embed_tokens.weight is tied.lm_head.weight
    assert units_without_outside_users(untied, units) == units
    assert units_without_outside_users(tied, units) == units[1:]
    # the decoder holds the embedding but not the lm_head: left to the root as well
    assert units_without_outside_users(tied, ["model", *units[1:]]) == units[1:]
    assert units_without_outside_users(untied, ["model", *units[1:]]) == ["model", *units[1:]]
