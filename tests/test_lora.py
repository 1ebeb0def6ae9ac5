"""LoRA at every layout (issue 41): one ``Policy.train`` step with adapters equals the unsharded
PEFT model's step on the whole batch (loss, gradient norm before clipping, every adapter's
gradient within 1e-5 of the fp64 step or 4x fp32's own distance), only the adapters train,
every base weight is bitwise unchanged, and ``weights()`` streams PEFT's ``merge_and_unload``.
The adapters sit on colwise (q, gate) and rowwise (o, down) layers, so both placements run."""

import pytest

from .test_policy import BUDGET, ONE, PACKED, TOLERANCE, UNEVEN

ATTENTION = ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.o_proj"]
MLP = ["model.layers.*.mlp.gate_proj", "model.layers.*.mlp.down_proj"]

LAYOUTS = [
    # (ranks, plan, model, layout, targets, cases)
    pytest.param(
        2,
        "plans/qwen3.yaml",
        "tiny-qwen3",
        {"dp": 2},
        ATTENTION + MLP,
        [("nll", ONE), ("grpo_tokens", PACKED)],
        id="dp2",
    ),
    pytest.param(
        2,
        "plans/qwen3.yaml",
        "tiny-qwen3",
        {"tp": 2},
        ATTENTION + MLP,
        [("grpo", UNEVEN), ("nll_tokens", ONE)],
        id="tp2",
    ),
    pytest.param(
        2,
        "plans/qwen3.yaml",
        "tiny-qwen3",
        {"tp": 2, "sp": True},
        ATTENTION + MLP,
        [("grpo", BUDGET), ("grpo_tokens", PACKED)],
        id="tp2-sp",
    ),
    pytest.param(
        2,
        "plans/qwen3.yaml",
        "tiny-qwen3",
        {"cp": 2},
        ATTENTION + MLP,
        [("grpo", UNEVEN), ("nll_tokens", PACKED)],
        id="cp2",
    ),
    pytest.param(
        4,
        "plans/qwen3.yaml",
        "tiny-qwen3",
        {"dp": 2, "tp": 2},
        ATTENTION + MLP,
        [("grpo_tokens", UNEVEN)],
        id="dp2xtp2",
    ),
    pytest.param(
        2, "plans/qwen3_moe.yaml", "tiny-qwen3-moe", {"ep": 2}, ATTENTION, [("grpo", BUDGET)], id="ep2-attention"
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("ranks", "plan", "model", "layout", "targets", "cases"), LAYOUTS)
def test_a_lora_step_equals_the_unsharded_peft_model_on_the_whole_batch(ranks, plan, model, layout, targets, cases):
    from .distributed import launch
    from .lora_worker import lora_train_cases

    results = launch(lora_train_cases, ranks, plan, model, layout, targets, cases)
    for rank, rows in results.items():
        for row in rows:
            assert row["loss_diff"] <= TOLERANCE, (rank, row)
            assert row["grad_norm_diff"] <= TOLERANCE, (rank, row)
            ratio, name, error, bar, compared = row["gradient"]
            assert ratio <= 1.0 and compared > 0, (rank, row["loss"], row["cutting"], name, error, bar)
            assert row["trained"], (rank, "the optimizer stepped more or fewer tensors than the adapters")
            assert row["base_changed"] == [], (rank, row["base_changed"])
            assert row["merged_names"] and row["merged_error"] <= 1e-5, (rank, row)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_reference_is_the_base_and_weights_go_out_merged_or_as_peft_adapters(tmp_path):
    from .distributed import launch
    from .lora_worker import reference_export_and_resume

    results = launch(
        reference_export_and_resume, 2, "plans/qwen3.yaml", "tiny-qwen3", {"tp": 2}, ATTENTION + MLP, str(tmp_path)
    )
    for rank, out in results.items():
        assert out["reference_copy"] is False, rank  # no second copy of the weights
        assert out["reference_vs_base"] <= 1e-5, (rank, out)
        assert out["trained_vs_base"] > 1e-3, (rank, out)  # the adapters are on in logprobs
        assert out["resumed_equal"] and out["next_step_equal"], (rank, out)
        assert out["checkpoint_holds_adapters_only"], rank  # the base is --model's, not in every checkpoint
        assert "trained on the base 'random init (seed 0)'" in out["other_base"], out["other_base"]
        saved, unsaved = out["refusals"]
        assert saved is not None and "holds LoRA adapters" in saved and "lora=" in saved, saved
        assert unsaved is not None and "holds no LoRA adapters" in unsaved, unsaved
        assert out["adapter_manifest"] == [True, 4], out["adapter_manifest"]
    rank0 = results[0]
    assert rank0["adapter_stream_equal"], rank0
    assert rank0["merged_export_names"] and rank0["merged_export_vs_stream"] == 0.0, rank0
    assert rank0["adapter_files"] == ["adapter_config.json", "adapter_model.safetensors"], rank0
    assert rank0["peft_loaded_vs_policy"] <= 1e-5, rank0


def test_explain_counts_the_bytes_a_lora_policy_holds(one_rank, write_plan):
    """``plancc explain`` with a lora: section: parameters (base and adapters), gradients and
    AdamW state of the adapters only -- the bytes a Policy holds after a step (one rank)."""
    import torch

    import plancc
    from plancc.checks.report import validate_plan
    from plancc.tools.explain import explain

    path = write_plan(
        open("plans/qwen3.yaml").read()
        + "\nlora:\n  r: 4\n  alpha: 8\n  targets: [model.layers.*.self_attn.*_proj, model.layers.*.mlp.*_proj]\n"
    )
    report = validate_plan(path, model="tiny-qwen3", skeleton=False, world_size=1)
    exp = explain(report.meta_model, report.resolved_for(False), report.layout, lora=report.plan.lora)
    policy = plancc.Policy(path, "tiny-qwen3", device="cpu")
    batch = {"input_ids": torch.randint(0, 200, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    grads = []  # the gradients the optimizer steps on (the step sets them to None after)

    def held(optimizer, args, kwargs):
        grads.append(sum(p.grad.numel() * p.grad.element_size() for p in policy.model.parameters() if p.grad is not None))

    policy.optimizer.register_step_pre_hook(held)
    policy.train(batch, lambda lp, mb, norm: -lp.sum() / norm.tokens)
    params = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    (grads,) = grads
    state = sum(
        t.numel() * t.element_size()
        for s in policy.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    assert (exp.param_bytes, exp.grad_bytes, exp.optimizer_bytes) == (params, grads, state)
    assert grads < params / 10  # the adapters only
