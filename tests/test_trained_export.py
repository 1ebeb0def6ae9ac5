"""What `plancc apply --export-hf` writes is what training made: the export after N steps
equals the unsharded model trained on the whole batch, for every shape of plan (with FSDP
units, without an `fsdp` section, with empty units, with one rule) at tp=2 and dp=2.

A plan without FSDP units leaves the root as the only unit; the fused loss read the lm_head's
input and weight beside the model's output, so FSDP2's root backward hook never ran, the
gradients never reached the sharded parameters, and the optimizer stepped nothing: the loss
moved while the export held the initial weights, and the run exited 0."""

import pytest
from safetensors.torch import load_file

from .conftest import PLANS, forked_cli, step_losses
from .distributed import launch
from .export_worker import trained_exports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHIPPED = (PLANS / "qwen3.yaml").read_text()
PLAN_SHAPES = {
    "shipped": SHIPPED,
    "no-fsdp-section": SHIPPED.split("\nfsdp:")[0] + "\n",
    "empty-units": SHIPPED.replace("units: [model.embed_tokens, model.layers.*]", "units: []"),
    "lm-head-only": "plancc: 1\nname: lm-head-only\narchitectures: [Qwen3ForCausalLM]\n"
    "tensor_parallel:\n  lm_head: colwise_logits\n",
}
LAYOUTS = [(1, 2), (2, 1)]  # (dp, tp)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    cases = [(name, text, dp, tp) for name, text in PLAN_SHAPES.items() for dp, tp in LAYOUTS]
    return launch(trained_exports, 2, cases, str(tmp_path_factory.mktemp("exports")))[0]


@pytest.mark.parametrize("dp,tp", LAYOUTS)
@pytest.mark.parametrize("shape", PLAN_SHAPES)
def test_the_export_after_training_is_the_trained_model(exports, shape, dp, tp):
    case = exports[f"{shape} dp{dp} tp{tp}"]
    assert case["tensors"] > 20
    assert case["from_initial"] > 1e-3, "the export holds the initial weights"
    assert case["from_trained"] < 1e-5, "the export differs from the unsharded model trained on the whole batch"


def test_apply_without_fsdp_units_exports_what_it_trained(tmp_path):
    """The CLI end to end: the export after 2 steps differs from the initial weights in every
    tensor (apply's seeded init is build_model's under torch.manual_seed(seed))."""
    import torch

    from plancc.models import build_model, load_config

    plan = tmp_path / "no-fsdp.yaml"
    plan.write_text(PLAN_SHAPES["no-fsdp-section"])
    code, out, err = forked_cli("apply", plan, "--model", "tiny-qwen3", "--nproc-per-node", 2, "--tp", 2,
                             "--steps", 2, "--export-hf", tmp_path / "out")
    assert code == 0, err + out
    assert len(step_losses(out)) == 2
    torch.manual_seed(0)
    before = build_model(load_config("tiny-qwen3"), device="cpu").state_dict()
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    moved = {k for k in after if (after[k] - before[k]).abs().max() > 1e-4}
    assert moved == set(after), f"not trained: {sorted(set(after) - moved)}"


def test_a_step_that_would_not_update_the_model_is_refused():
    """The runner's guard: an optimizer that holds other tensors than the model's parameters."""
    import torch

    from plancc import PlanError
    from plancc.errors import SourceLoc
    from plancc.runtime.stepping import require_stepped

    model = torch.nn.Linear(2, 2)
    stale = torch.optim.SGD([torch.nn.Parameter(p.detach().clone()) for p in model.parameters()], lr=0.1)
    with pytest.raises(PlanError) as caught:
        require_stepped(model, stale, where=SourceLoc(path="plan.yaml"))
    assert caught.value.diagnostics[0].rule == "untrained-parameters"
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PlanError, match="received a gradient"):
        require_stepped(model, fresh, where=SourceLoc(path="plan.yaml"))  # no backward yet
    model(torch.ones(1, 2)).sum().backward()
    require_stepped(model, fresh, where=SourceLoc(path="plan.yaml"))
