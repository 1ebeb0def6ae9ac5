"""An elementwise optimizer steps the parameters' local shards (``runtime.local_step``): the
same update, bitwise, as stepping the DTensors through DTensor's dispatch, and the optimizer's
state kept as the DTensors it would hold otherwise (what checkpoints and resharding read)."""

import pytest

LAYOUTS = {"dp2": {"dp": 2}, "tp2-sp": {"tp": 2, "sp": True}}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("layout", "optimizer"),
    [("dp2", "adamw-scheduled"), ("tp2-sp", "adamw-fused"), ("dp2", "sgd-momentum")],
)
def test_a_step_on_the_local_shards_is_the_dtensor_step_bitwise(layout, optimizer):
    from .distributed import launch
    from .local_step_worker import both_ways

    for rank, r in launch(both_ways, 2, "plans/qwen3.yaml", "tiny-qwen3", LAYOUTS[layout], optimizer).items():
        assert r["params_bitwise"] and r["state_keys_equal"] and r["state_bitwise"], (rank, r)
        assert r["kept_as"] == r["want_kept_as"], (rank, r)  # DTensor state where DTensor's step keeps it
        assert any(k.startswith("dtensor:") for k in r["kept_as"]), (rank, r)
        # the local way built a twin; the other built none, and the first policy's went with it
        assert r["twins"] == (1, 0), (rank, r)
        # every step of the optimizer's class ran on plain local tensors one way, on DTensors the
        # other (a schedule's wrapper of the optimizer's step diverts neither); no schedule warning
        assert r["steps_on_dtensors"] == ([False] * 3, [True] * 3), (rank, r)
        assert r["schedule_warned"] == (False, False), (rank, r)


def test_an_optimizer_of_another_kind_steps_as_it_is():
    import torch

    from plancc.runtime.local_step import optimizer_step

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.Adagrad([param], lr=0.5)
    optimizer_step(optimizer)
    want = torch.nn.Parameter(torch.ones(3))
    want.grad = torch.ones(3)
    other = torch.optim.Adagrad([want], lr=0.5)
    other.step()
    assert torch.equal(param, want)
