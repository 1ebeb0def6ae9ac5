"""``plancc.Policy`` takes its layout one way: ``layout=``, a ``Layout`` or a mesh built by
``plancc.build_mesh`` (None: every rank data-parallel). plancc 0.x's ``tp=/cp=/ep=/dp=/sp=/pp=``
and ``mesh=`` keywords are gone: Python's own ``TypeError`` names the keyword. A fake world of
4 ranks: nothing here communicates."""

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


@pytest.mark.parametrize("keyword", ["tp", "dp", "pp", "mesh"])
def test_the_keywords_of_plancc_0x_are_gone(fake_world, keyword):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        _policy(**{keyword: 2})


def test_a_layout_that_is_neither_a_layout_nor_a_mesh_is_refused_naming_the_way(fake_world):
    with pytest.raises(TypeError, match=r"layout=plancc.Layout\(tp=2"):
        _policy(layout={"tp": 2})


@pytest.mark.parametrize(
    "way",
    [
        lambda plancc: {"layout": plancc.Layout(dp=2, tp=2)},
        lambda plancc: {"layout": plancc.build_mesh(dp=2, tp=2, device_type="cpu")},
    ],
    ids=["layout", "built-mesh"],
)
def test_each_way_of_giving_the_layout_gives_the_same_one(fake_world, way):
    import plancc

    policy = _policy(**way(plancc))
    assert policy.layout == plancc.Layout(dp=2, tp=2)


def test_no_layout_is_every_rank_data_parallel(fake_world):
    import plancc

    assert _policy().layout == plancc.Layout(dp=4)
