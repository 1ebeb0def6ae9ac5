"""Activation checkpointing from the plan: full recompute repeats every matmul of the target
in backward; `save: [matmul]` keeps their outputs, so backward runs exactly the matmuls of
an un-checkpointed model. Gradients are the same in all three."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import plancc
from plancc.runtime.activation_checkpointing import SAVE_GROUPS, apply_activation_checkpointing
from plancc.models import build_model, load_config
from plancc.compiler.resolve import resolve_plan
from plancc.compiler.schema import plan_schema

HEAD = "plancc: 1\nname: t\narchitectures: [Qwen3ForCausalLM]\ntensor_parallel: {}\n"
MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm}


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in MATMULS
        return func(*args, **(kwargs or {}))


def backward_matmuls_and_grads(write_plan, checkpointing: str):
    torch.manual_seed(0)
    model = build_model(load_config("tiny-qwen3"), device="cpu")
    if checkpointing:
        plan = plancc.load_plan(write_plan(HEAD + checkpointing))
        resolved = resolve_plan(plan, model)
        apply_activation_checkpointing(model, resolved.activation_checkpointing, resolved.checkpoint_saves)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids).logits.float().pow(2).mean()
    with CountMatmuls() as counter:
        loss.backward()
    return counter.count, {n: p.grad for n, p in model.named_parameters()}


def test_selective_checkpointing_keeps_matmul_outputs_and_full_recomputes_them(write_plan):
    plain, want = backward_matmuls_and_grads(write_plan, "")
    full, full_grads = backward_matmuls_and_grads(write_plan, "activation_checkpointing: [model.layers.*.mlp]\n")
    selective, sel_grads = backward_matmuls_and_grads(
        write_plan, "activation_checkpointing:\n  - {module: model.layers.*.mlp, save: [matmul]}\n")
    # gate_proj and up_proj run again in each layer's mlp; down_proj's output is not needed
    # by any backward formula, and checkpoint stops recomputing once it has what it needs
    layers, recomputed = 2, 2
    assert full == plain + layers * recomputed
    assert selective == plain  # nothing but the cheap elementwise work is recomputed
    for name, grad in want.items():
        torch.testing.assert_close(full_grads[name], grad, rtol=0, atol=0)
        torch.testing.assert_close(sel_grads[name], grad, rtol=0, atol=0)


def test_save_groups_in_the_schema_are_the_table():
    assert plan_schema()["$defs"]["save_group"]["enum"] == list(SAVE_GROUPS)
    assert all(SAVE_GROUPS.values()), json.dumps({k: len(v) for k, v in SAVE_GROUPS.items()})


@pytest.mark.parametrize("item,rule,column", [
    ("{module: model.layers.*.mlp, save: [matmull]}", "invalid-value", 41),
    ("{modul: model.layers.*.mlp}", "unknown-key", 6),
    ("{module: 'model..mlp'}", "invalid-glob", 14),
    ("3", "wrong-type", 5),
])
def test_bad_checkpoint_items_are_reported_where_written(write_plan, item, rule, column):
    with pytest.raises(plancc.PlanError) as info:
        plancc.load_plan(write_plan(HEAD + f"activation_checkpointing:\n  - {item}\n"))
    assert (rule, 6, column) in [(d.rule, d.line, d.column) for d in info.value.diagnostics]


def test_one_module_checkpointed_two_ways_is_a_conflict_at_the_later_entry(write_plan):
    from plancc.models import build_meta_model

    plan = plancc.load_plan(write_plan(HEAD + "activation_checkpointing:\n  - model.layers.*.mlp\n"
                                              "  - {module: model.layers.1.mlp, save: [matmul]}\n"))
    with pytest.raises(plancc.PlanError) as info:
        resolve_plan(plan, build_meta_model("tiny-qwen3"))
    [diag] = info.value.diagnostics
    assert (diag.rule, diag.line) == ("rule-conflict", 7) and "(line 6) saving nothing" in diag.message
