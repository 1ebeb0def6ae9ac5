"""One parallel-mesh object from the CLI to every runtime call: ``plancc.build_mesh`` returns
a ``ParallelMesh`` (layout, device mesh, expert mesh) that ``parallelize`` and the loss take
whole, and plancc 0.1's loose keywords on a bare DeviceMesh still mean the same."""

import pytest

from plancc.layout import Layout


def test_a_layout_survives_its_serialised_form():
    layout = Layout(dp=2, tp=2, ep=2, sequence_parallel=True)
    assert Layout(**layout.to_json()) == layout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sequence_parallel_said_by_the_mesh_or_by_the_old_keywords_trains_the_same():
    from .distributed import launch
    from .parallel_mesh_worker import three_ways_to_say_sp

    for rank, got in launch(three_ways_to_say_sp, 2).items():
        assert got["is_parallel_mesh"] and got["tp"] == 2 and got["sp"], (rank, got)
        assert got["rebuilt_equal"] and got["copy_equal"] and got["layout_of"], (rank, got)
        assert got["sequence_seen"] == {"layout": 8, "keyword": 8, "device_mesh": 8}, (rank, got)  # 16 / tp
        assert got["fused_mesh_equals_group"] and got["fused_mesh_right"], (rank, got)
        losses = got["losses"]
        assert losses["layout"] == losses["keyword"] == losses["device_mesh"], (rank, losses)
