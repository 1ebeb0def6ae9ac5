"""Plans an adversarial pass wrote that validated clean, then trained wrong or crashed with a raw
torch error (issue: second adversarial pass). Each is an edit a user makes to the shipped qwen3
plan; `validate` (static, no --sp) now refuses it at the line of the rule at fault, with the
rule id that says why. A failure that still gets past the checks is one diagnostic at the rule
of the module it happened in (dry run and run time)."""

from __future__ import annotations

import pytest

import plancc
from plancc.models import load_config

from .conftest import PLANS
from .distributed import init_gloo, launch

QWEN3 = (PLANS / "qwen3.yaml").read_text()
TP_SECTION = QWEN3.split("\nsequence_parallel:")[0]


def edited(*changes: tuple[str, str]) -> str:
    """The shipped plan with its tensor_parallel section edited (SP overlay and the rest kept)."""
    text = TP_SECTION
    for old, new in changes:
        assert old in text, old
        text = text.replace(old, new)
    return text + QWEN3[len(TP_SECTION) :]


def line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if fragment in line)


ADD = "  lm_head: colwise_logits\n"
MLP = "  model.layers.*.mlp.down_proj: rowwise\n"
BLOCK = "  model.layers.*.mlp: shared_input\n"

# case -> (plan text, rule id, the fragment of the line it must point at)
CASES = {
    # 2: trained wrong, exit 0 (loss 2.25e-2 off the unsharded model)
    "v-left-whole": (edited(("  model.layers.*.self_attn.v_proj: colwise\n", "")), "mixed-shards",
                     "self_attn.o_proj: rowwise"),
    # 3: died at run time with raw torch errors
    "colwise-dtensor-output": (
        edited(("  model.layers.*.mlp.gate_proj: colwise\n",
                "  model.layers.*.mlp.gate_proj: {style: colwise, use_local_output: false}\n")),
        "dtensor-output", "gate_proj: {style: colwise, use_local_output: false}"),
    "colwise-output-shard0": (
        edited(("  model.layers.*.mlp.gate_proj: colwise\n",
                "  model.layers.*.mlp.gate_proj: {style: colwise, output_layouts: shard(0)}\n")),
        "layout-pairing", "output_layouts: shard(0)"),
    "embedding-seq-without-sp": (edited(("model.embed_tokens: embedding_rowwise", "model.embed_tokens: embedding_seq")),
                                 "sequence-parallel", "embedding_seq"),
    "gather-seq-input-without-sp": (edited((BLOCK, "  model.layers.*.mlp: gather_seq_input\n")),
                                    "sequence-parallel", "mlp: gather_seq_input"),
    "rowwise-seq-without-sp": (edited((MLP, "  model.layers.*.mlp.down_proj: rowwise_seq\n")),
                               "sequence-parallel", "down_proj: rowwise_seq"),
    "rowwise-output-shard1-without-sp": (
        edited((MLP, "  model.layers.*.mlp.down_proj: {style: rowwise, output_layouts: shard(1)}\n")),
        "sequence-parallel", "output_layouts: shard(1)"),
    "rotary-sp-without-sp": (edited((ADD, ADD + "  model.rotary_emb: rotary_sp\n")), "sequence-parallel",
                             "rotary_sp"),
    "only-v-sharded": (
        edited(("  model.layers.*.self_attn.q_proj: colwise\n", ""), ("  model.layers.*.self_attn.k_proj: colwise\n", ""),
               ("  model.layers.*.self_attn.q_norm: {style: qk_norm, optional: true}\n", ""),
               ("  model.layers.*.self_attn.k_norm: {style: qk_norm, optional: true}\n", "")),
        "mixed-shards", "self_attn.o_proj: rowwise"),
    "prepare-input-shard1-without-sp": (
        edited((BLOCK, "  model.layers.*.mlp: {style: prepare_input, input_layouts: shard(1)}\n")),
        "sequence-parallel", "input_layouts: shard(1)"),
    "huge-shard-dim": (
        edited(("  model.layers.*.mlp.gate_proj: colwise\n",
                "  model.layers.*.mlp.gate_proj: {style: colwise, output_layouts: shard(99999999999999999999)}\n")),
        "invalid-layout", "shard(99999999999999999999)"),
    # a block style on the whole decoder layer: its residual add meets the DTensor it hands on
    "shared-input-on-a-decoder-layer": (
        edited(("  model.layers.*.self_attn: shared_input\n", "  model.layers.*: shared_input\n"), (BLOCK, "")),
        "dtensor-output", "model.layers.*: shared_input"),
    # 4: accepted before; both are errors now
    "sequence-parallel-norm-without-sp": (edited((ADD, ADD + "  model.layers.*.input_layernorm: sequence_parallel\n")),
                                          "sequence-parallel", "input_layernorm: sequence_parallel"),
    "checkpointing-everything": (QWEN3.replace("activation_checkpointing: [model.layers.*.mlp]",
                                               "activation_checkpointing: ['**']"),
                                 "activation-checkpointing", "activation_checkpointing: ['**']"),
}


def errors_of(path) -> list:
    try:
        plan = plancc.load_plan(path)
    except plancc.PlanError as exc:  # refused while reading (schema)
        return [d for d in exc.diagnostics if d.is_error]
    return [d for d in plancc.check_plan(plan, "tiny-qwen3", tp=2) if d.is_error]


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_refuses_the_plan_at_the_rule_at_fault(case, write_plan):
    text, rule, fragment = CASES[case]
    found = {(d.rule, d.line) for d in errors_of(write_plan(text))}
    assert (rule, line_of(text, fragment)) in found, found


def test_the_shipped_plan_it_was_edited_from_is_clean(write_plan):
    assert errors_of(write_plan(QWEN3)) == []


def test_validate_prints_one_line_and_a_fix_per_case(cli, write_plan):
    text, _, fragment = CASES["v-left-whole"]
    path = write_plan(text)
    code, out, err = cli("validate", path, "--model", "tiny-qwen3", "--tp", "2")
    assert code == 1
    line = next(x for x in err.splitlines() if "[mixed-shards]" in x)
    assert line.startswith(f"{path}:{line_of(text, fragment)}:3: error:") and "v_proj (left whole)" in line
    assert "fix: add 'model.layers.*.self_attn.v_proj: colwise'" in err and "Traceback" not in err


def test_a_dry_run_failure_names_the_module_and_points_at_its_rule(write_plan):
    """What the checks cannot see fails in the dry run: at the rule of the module it failed after."""
    from plancc.tools.dryrun import dry_run

    text = CASES["gather-seq-input-without-sp"][0]
    report = dry_run(plancc.load_plan(write_plan(text)), load_config("tiny-qwen3"), plancc.Layout(tp=2))
    (diag,) = report.diagnostics
    assert diag.rule == "dry-run" and diag.line == line_of(text, "mlp: gather_seq_input")
    assert "failed in model.layers.0 after model.layers.0.mlp" in diag.message and "512" in diag.message


def _train_one_step(plan_text, root):
    """Rank side: parallelize a plan the checks refuse (through the Python API, which does not
    check), take a step inside `diagnosed`, and return the diagnostic it raised."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from plancc.errors import SourceLoc
    from plancc.models import build_model
    from plancc.runtime.failures import diagnosed

    init_gloo()
    try:
        path = Path(root) / "plan.yaml"
        if dist.get_rank() == 0:
            path.write_text(plan_text)
        dist.barrier()
        mesh = plancc.build_mesh(tp=2, device_type="cpu")
        model = build_model(load_config("tiny-qwen3"), device="cpu")
        plancc.parallelize(model, plancc.load_plan(path), mesh)
        ids = torch.randint(0, 100, (2, 16))
        try:
            with diagnosed("training", fallback=SourceLoc(path=str(path))):
                plancc.causal_lm_loss(model, ids, mesh=mesh).backward()
        except plancc.PlanError as exc:
            (diag,) = exc.diagnostics
            return {"rule": diag.rule, "line": diag.line, "message": diag.message}
        return None
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_time_failure_is_one_diagnostic_at_the_rule(tmp_path):
    text = CASES["gather-seq-input-without-sp"][0]
    result = launch(_train_one_step, 2, text, str(tmp_path))
    for diag in result.values():
        assert diag is not None and diag["rule"] == "run-time-layout"
        assert diag["line"] == line_of(text, "mlp: gather_seq_input")
        assert "training failed in model.layers.0 after model.layers.0.mlp" in diag["message"]
        assert "RuntimeError" in diag["message"] and "32" in diag["message"]  # the gathered length


@pytest.mark.parametrize("message,diagnosed_as_layout", [
    ("The size of tensor a (32) must match the size of tensor b (16) at non-singleton dimension 1", True),
    ("[/x/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1", False),
])
def test_only_failures_of_the_model_itself_are_blamed_on_the_plan(message, diagnosed_as_layout):
    """A collective that fails because a peer died is the launcher's to report (rank-failed)."""
    import torch

    from plancc.errors import SourceLoc
    from plancc.models import build_model
    from plancc.runtime import failures

    model = build_model(load_config("tiny-qwen3"), device="cpu")
    failures.remember(model, plancc.resolve_plan(plancc.load_plan(PLANS / "qwen3.yaml"), model))

    def fail(*_):
        raise RuntimeError(message)

    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(fail)
    ids = torch.randint(0, 100, (1, 8))
    expected = plancc.PlanError if diagnosed_as_layout else RuntimeError
    with pytest.raises(expected) as caught, failures.diagnosed("training", fallback=SourceLoc(path="p.yaml")):
        model(input_ids=ids)
    if diagnosed_as_layout:
        (diag,) = caught.value.diagnostics
        assert diag.rule == "run-time-layout"
        assert "training failed in model.layers.0.mlp.down_proj (rule " in diag.message and "(32)" in diag.message
        assert diag.line == line_of(QWEN3, "mlp.down_proj: rowwise")
