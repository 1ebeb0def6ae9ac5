"""LoRA's bad input (issue 41, point 8): each mistake is one diagnostic naming what was found
and what is allowed, raised before a weight exists; the plan's ``lora:`` section is
schema-checked at its line, and ``plancc validate`` reports a target problem with exit 1.
(The styles that cannot carry adapters, and dropout under tp: ``plancc rules``' examples,
run by tests/test_rule_examples.py. A LoRA checkpoint into a policy without LoRA and the
reverse: tests/test_lora.py.)"""

import pytest

from plancc.errors import PlanError

TARGETS = ["model.layers.*.self_attn.q_proj"]


def _policy(lora, plan="plans/qwen3.yaml"):
    import plancc

    return plancc.Policy(plan, "tiny-qwen3", device="cpu", lora=lora)


@pytest.mark.parametrize(
    "lora, rule, words",
    [
        ({"r": 0, "targets": TARGETS}, "lora-config", ["lora r is 0", "above 0"]),
        ({"r": 4, "alpha": -1, "targets": TARGETS}, "lora-config", ["alpha is -1"]),
        ({"r": 4, "targets": TARGETS, "rank": 4}, "lora-config", ["unknown lora field 'rank'"]),
        ({"r": 4, "targets": []}, "lora-config", ["targets are []"]),
        ({"r": 4, "targets": ["model.layers.*.self_attn.qq_proj"]}, "lora-targets", ["matches no module"]),
        ({"r": 4, "targets": ["model.layers.*.self_attn"]}, "lora-targets", ["Qwen3Attention", "nn.Linear"]),
        ({"r": 4, "targets": ["model.layers.*.input_layernorm"]}, "lora-targets", ["not an nn.Linear"]),
        ({"r": 4, "targets": ["lm_head"]}, "lora-targets", ["output embedding"]),
        ({"r": 1000, "targets": TARGETS}, "lora-targets", ["r=1000 exceeds", "r <= 64"]),
    ],
    ids=[
        "r-zero",
        "alpha-negative",
        "unknown-field",
        "no-targets",
        "no-match",
        "a-block",
        "a-norm",
        "lm-head",
        "r-too-large",
    ],
)
def test_a_bad_lora_config_is_one_diagnostic(one_rank, lora, rule, words):
    with pytest.raises(PlanError) as caught:
        _policy(lora)
    (diagnostic,) = caught.value.diagnostics
    assert diagnostic.rule == rule, diagnostic.format()
    for word in words:
        assert word in diagnostic.format(), diagnostic.format()
    assert diagnostic.fix


def _lora_plan(write_plan, lora_yaml):
    text = open("plans/qwen3.yaml").read() + "\nlora:\n" + lora_yaml
    return write_plan(text)


def test_a_plans_lora_section_is_schema_checked_at_its_line(write_plan):
    import plancc

    path = _lora_plan(write_plan, "  r: -2\n  targets: [model.layers.*.self_attn.q_proj]\n")
    with pytest.raises(PlanError) as caught:
        plancc.load_plan(path)
    text = "\n".join(d.format() for d in caught.value.diagnostics)
    line = open(path).read().splitlines().index("  r: -2") + 1
    assert f"{path}:{line}:" in text and "-2" in text, text


def test_a_plans_lora_section_trains_the_adapters_alone(one_rank, write_plan):
    import torch

    import plancc

    path = _lora_plan(write_plan, "  r: 4\n  alpha: 8\n  targets:\n    - model.layers.*.self_attn.q_proj\n")
    policy = plancc.Policy(
        path, "tiny-qwen3", device="cpu", optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}}
    )
    trained = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trained == [f"model.layers.{i}.self_attn.q_proj.lora_{ab}.weight" for i in (0, 1) for ab in "AB"]
    assert sum(len(g["params"]) for g in policy.optimizer.param_groups) == 4
    batch = {"input_ids": torch.randint(0, 200, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    policy.train(batch, lambda lp, mb, norm: -lp.sum() / norm.tokens)
    after = policy.model.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == [
        f"model.layers.{i}.self_attn.q_proj.lora_B.weight" for i in (0, 1)
    ]  # B starts at 0: A's grad is 0


def test_validate_reports_a_lora_target_at_its_line(cli, write_plan):
    path = _lora_plan(write_plan, "  r: 4\n  targets:\n    - model.layers.*.self_attn.q_proj\n    - lm_head\n")
    code, out, err = cli("validate", path, "--model", "tiny-qwen3", "--tp", "2")
    line = open(path).read().splitlines().index("    - lm_head") + 1
    assert code == 1, out + err
    assert f"{path}:{line}:" in out + err and "[lora-targets]" in out + err, out + err


def test_apply_refuses_bad_lora_flags_before_launch(cli):
    code, out, err = cli("apply", "plans/qwen3.yaml", "--lora-r", "4", "--lora-targets", "lm_head", "--tp", "2")
    assert code == 1 and "[lora-targets]" in out + err and "output embedding" in out + err, out + err
    code, out, err = cli("apply", "plans/qwen3.yaml", "--lora-r", "0", "--lora-targets", TARGETS[0])
    assert code == 1 and "[lora-config]" in out + err, out + err
    code, out, err = cli("apply", "plans/qwen3.yaml", "--lora-alpha", "4")
    assert code == 2 and "--lora-r" in out + err, out + err
    code, out, err = cli("apply", "plans/qwen3.yaml", "--lora-r", "4", "--lora-targets", TARGETS[0], "--verify")
    assert code == 2 and "--verify" in out + err, out + err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_apply_trains_lora_adapters_from_the_flags(tmp_path):
    from .conftest import forked_cli, step_losses

    code, out, err = forked_cli(
        "apply", "plans/qwen3.yaml", "--steps", "3", "--tp", "2", "--lora-r", "4", "--lora-alpha", "8",
        "--lora-targets", "model.layers.*.self_attn.q_proj,model.layers.*.mlp.down_proj", "--lr", "1e-2",
        "--export-hf", str(tmp_path / "hf"),
    )  # fmt: skip
    assert code == 0, err
    assert "LoRA r=4 on 4 modules" in out + err
    assert len(step_losses(out)) == 3
    assert (tmp_path / "hf" / "model.safetensors").is_file()  # merged: the base model's names


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
def test_adapters_take_the_dtype_of_their_base_layer(one_rank, param_dtype):
    """A config whose weights are bf16 (as Qwen3's presets say): the base's masters are fp32
    (tests/test_master_weights.py) and so are the adapters (bf16 adapters on an fp32 base failed
    the first matmul, "expected m1 and m2 to have the same dtype"); bf16 compute casts both."""
    import torch

    import plancc
    from plancc.models import load_config

    config = load_config("tiny-qwen3")
    config.dtype = torch.bfloat16
    policy = plancc.Policy(
        "plans/qwen3.yaml", config, device="cpu", lora={"r": 4, "targets": TARGETS}, param_dtype=param_dtype
    )
    adapters = [p for n, p in policy.model.named_parameters() if ".lora_" in n]
    base = [p for n, p in policy.model.named_parameters() if ".lora_" not in n]
    assert adapters and {p.dtype for p in adapters} == {p.dtype for p in base} == {torch.float32}
    batch = {"input_ids": torch.randint(0, 200, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    assert torch.isfinite(torch.tensor(policy.train(batch, lambda lp, mb, n: -lp.sum() / n.tokens)["loss"]))
