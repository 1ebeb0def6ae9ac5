"""The gradient-scaling invariant (``plancc.runtime.gradient_scale``): FSDP divides the summed
gradients by dp x cp, every cp rank computes its dp rank's whole loss share (the log-probs are
all-gathered, so the gather's backward sums cp copies), and ``Policy.train`` scales the loss by
``dp = dp x cp / cp``. Stated once, taken from one place by ``parallelize`` and ``Policy``, and
checked here at dp2, cp2 and dp2 x cp2: the step's gradients and update are the unsharded
model's on the whole batch."""

import pytest

from plancc.layout import Layout
from plancc.runtime.gradient_scale import cp_loss_copies, fsdp_divisor, loss_scale

from .test_policy import EXACT_FACTOR, ONE, TOLERANCE


@pytest.mark.parametrize(
    ("layout", "divisor", "scale"),
    [
        (Layout(dp=2), 2.0, 2.0),
        (Layout(cp=2), 2.0, 1.0),
        (Layout(dp=2, cp=2), 4.0, 2.0),
        (Layout(dp=2, tp=2), 2.0, 2.0),  # tp ranks hold the same rows: no factor of their own
        (Layout(dp=4, ep=2), 4.0, 4.0),  # experts' FSDP ranks (dp / ep) still divide by all of dp
    ],
)
def test_the_loss_scale_is_what_fsdp_divides_by_over_the_cp_copies_of_the_loss(layout, divisor, scale):
    assert fsdp_divisor(layout) == divisor
    assert loss_scale(layout) == scale == fsdp_divisor(layout) / cp_loss_copies(layout)


def test_every_fsdp_unit_divides_by_the_invariants_divisor():
    """Every FSDP unit's gradient reduction divides by ``fsdp_divisor`` (a fake world of 4 ranks):
    the dense units by FSDP's default, the size of the dp x cp mesh they shard over; experts
    spread over ep, which shard over fewer ranks, because parallelize tells them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import plancc
    from plancc.models import build_model, load_config

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = plancc.build_mesh(dp=2, cp=2, device_type="cpu")
        model = build_model(load_config("tiny-qwen3"), device="meta")
        plancc.parallelize(model, plancc.load_plan("plans/qwen3.yaml"), mesh)
        groups = {
            name: module._get_fsdp_state()._fsdp_param_group
            for name, module in model.named_modules()
            if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_group is not None
        }
        factors = {n: g.gradient_divide_factor or g.mesh_info.shard_mesh_size for n, g in groups.items()}
    finally:
        dist.destroy_process_group()
    assert factors and set(factors.values()) == {fsdp_divisor(Layout(dp=2, cp=2))}, factors


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("ranks", "layout"),
    [(2, {"dp": 2}), (2, {"cp": 2}), (4, {"dp": 2, "cp": 2})],
    ids=["dp2", "cp2", "dp2xcp2"],
)
def test_the_scaled_loss_gives_the_unsharded_models_gradients_and_step(ranks, layout):
    from .distributed import launch
    from .policy_worker import train_cases

    results = launch(train_cases, ranks, "plans/qwen3.yaml", "tiny-qwen3", layout, [("nll", ONE)])
    for rank, got in results.items():
        for row in got["cases"]:
            assert row["loss_diff"] <= TOLERANCE, (rank, row)
            ratio, name, error, bar, compared = row["gradient"]
            assert ratio <= 1.0 and compared > 0, (rank, name, error, bar)
            bar = max(TOLERANCE, EXACT_FACTOR * row["fp32_update_diff"])
            assert row["update_diff"] <= bar, (rank, row["worst_parameter"], row)
