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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rule_for_the_root_module_applies_to_the_model_itself():
    from .distributed import launch
    from .plain_module_worker import a_root_rule_gathers_the_output

    for rank, got in launch(a_root_rule_gathers_the_output, 2).items():
        assert got["type"] == "Tensor" and got["shape"] == [2, 8, 32] and got["diff"] < TOL, (rank, got)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2])
def test_fsdp_shards_the_parameters_the_plan_names_on_their_dim_and_trains_the_same(tp):
    from .distributed import launch
    from .plain_module_worker import fsdp_shards_on_the_dims_the_plan_names

    for rank, got in launch(fsdp_shards_on_the_dims_the_plan_names, 2 * tp, tp).items():
        assert (got["down"], got["embed"], got["up"]) == (1, 1, 0), (rank, got)
        assert got["loss_diff"] < TOL and got["grad_diff"] < TOL, (rank, got)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_positional_layouts_with_null_and_keyword_layouts_run_as_torch_lays_them_out():
    from .distributed import launch
    from .plain_module_worker import positional_and_keyword_inputs_laid_out_one_by_one

    for rank, got in launch(positional_and_keyword_inputs_laid_out_one_by_one, 2).items():
        assert got["output"] < TOL and got["grads"] < TOL, (rank, got)
