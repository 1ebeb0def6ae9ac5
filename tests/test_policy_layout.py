"""``plancc.Policy`` takes its layout one way: ``layout=`` (a ``Layout`` or a mesh built by
``plancc.build_mesh``), ``mesh=`` (the older name of the same), or the ``tp=/cp=/ep=/dp=/sp=``
shorthand. Two ways that disagree are a ``LayoutError`` naming both, before any model is built;
two that agree are accepted. A fake world of 4 ranks: nothing here communicates."""

import pytest


@pytest.fixture
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def _policy(**layout):
    import plancc

    return plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", device="cpu", **layout)


def test_shorthand_that_disagrees_with_the_layout_is_refused(fake_world):
    import plancc

    with pytest.raises(plancc.LayoutError) as err:
        _policy(layout=plancc.Layout(dp=2, tp=2), cp=2)
    assert "cp=2 (the layout has 1)" in str(err.value) and "one way" in str(err.value)


def test_a_layout_and_a_mesh_that_disagree_are_refused(fake_world):
    import plancc

    mesh = plancc.build_mesh(dp=4, device_type="cpu")
    with pytest.raises(plancc.LayoutError) as err:
        _policy(layout=plancc.Layout(dp=2, tp=2), mesh=mesh)
    assert "layout=dp=2 cp=1 tp=2" in str(err.value) and "mesh=dp=4" in str(err.value)


@pytest.mark.parametrize(
    "way",
    [
        lambda plancc: {"layout": plancc.Layout(dp=2, tp=2)},
        lambda plancc: {"layout": plancc.build_mesh(dp=2, tp=2, device_type="cpu")},
        lambda plancc: {"mesh": plancc.build_mesh(dp=2, tp=2, device_type="cpu")},
        lambda plancc: {"tp": 2},
        lambda plancc: {"layout": plancc.Layout(dp=2, tp=2), "tp": 2, "dp": 2},  # agreeing shorthand
    ],
    ids=["layout", "built-mesh-as-layout", "mesh", "shorthand", "layout-and-agreeing-shorthand"],
)
def test_each_way_of_giving_the_layout_gives_the_same_one(fake_world, way):
    import plancc

    policy = _policy(**way(plancc))
    assert policy.layout == plancc.Layout(dp=2, tp=2)
