"""``plancc.parallelize`` works on any ``nn.Module``: the Hugging Face pieces (the decoder's
global positions and masks under SP) apply where the model is one, and a plain PyTorch model,
as torch's own tensor-parallel tests build them, is parallelized by the same plan format."""

import pytest

TOL = 1e-5  # fp32, the same ops in another order (sharded matmuls summed over tp)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plain_module_under_sequence_parallelism_matches_the_whole_model():
    from .distributed import launch
    from .plain_module_worker import plain_module_under_sequence_parallelism

    for rank, got in launch(plain_module_under_sequence_parallelism, 2).items():
        assert got["output"] < TOL, (rank, got)
        assert max(got["grads"].values()) < TOL, (rank, got["grads"])
