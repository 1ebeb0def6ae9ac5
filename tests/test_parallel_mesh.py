"""One parallel-mesh object from the CLI to every runtime call: ``plancc.build_mesh`` returns
a ``ParallelMesh`` (layout, device mesh, expert mesh) that ``parallelize`` and the loss take
whole; a bare DeviceMesh, or plancc 0.1's loose keywords beside the mesh, are refused by name."""

import pytest

from plancc.layout import Layout


def test_a_layout_survives_its_serialised_form():
    layout = Layout(dp=2, tp=2, ep=2, sequence_parallel=True)
    assert Layout(**layout.to_json()) == layout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sequence_parallel_is_said_by_the_mesh_alone():
    from .distributed import launch
    from .parallel_mesh_worker import two_ways_to_say_sp

    for rank, got in launch(two_ways_to_say_sp, 2).items():
        assert got["is_parallel_mesh"] and got["tp"] == 2 and got["sp"], (rank, got)
        assert got["rebuilt_equal"] and got["copy_equal"] and got["sized_equal"], (rank, got)
        assert got["sequence_seen"] == {"layout": 8, "sizes": 8}, (rank, got)  # 16 / tp
        assert got["fused_mesh_equals_group"] and got["fused_mesh_right"], (rank, got)
        losses = got["losses"]
        assert losses["layout"] == losses["sizes"], (rank, losses)
        device_mesh, keyword = got["refused"]["device_mesh"], got["refused"]["keyword"]
        assert device_mesh.startswith("ValueError: plancc.parallelize takes the mesh plancc.build_mesh returns"), device_mesh
        assert "a DeviceMesh with axes ('dp', 'cp', 'tp') of sizes (1, 1, 2)" in device_mesh, device_mesh
        assert keyword.startswith("TypeError") and "sequence_parallel" in keyword, keyword
