"""The public names the issues spell out are a contract."""

import inspect

import plancc


def test_public_api_names_and_keywords():
    assert set(inspect.signature(plancc.load_plan).parameters) == {"path"}
    assert {"plan", "model", "tp_size", "sequence_parallel"} <= set(inspect.signature(plancc.compile_plan).parameters)
    assert {"plan", "model_or_config", "tp", "cp", "dp", "world_size", "sequence_parallel"} <= set(
        inspect.signature(plancc.check_plan).parameters)
    assert {"dp", "cp", "tp", "device_type"} <= set(inspect.signature(plancc.build_mesh).parameters)
    # the layout is the mesh's (build_mesh): plancc 0.1's sequence_parallel= / ep= are gone (issue 75)
    assert set(inspect.signature(plancc.parallelize).parameters) == {
        "model", "plan", "mesh", "param_dtype", "reduce_dtype", "cpu_offload", "activation_checkpointing", "lora"}
    assert {"logits", "targets", "group", "vocab_start", "chunk_size"} <= set(
        inspect.signature(plancc.logprobs.vocab_parallel_logprobs).parameters)
    assert {"model", "input_ids", "attention_mask", "mesh", "position_ids", "cp", "temperature"} <= set(
        inspect.signature(plancc.logprobs.token_logprobs).parameters)
    for name in ["load_balanced_indices", "shard", "unshard", "all_gather"]:
        assert callable(getattr(plancc.cp, name))
    assert {"path", "line", "column", "rule", "message", "fix", "severity"} <= {
        n for n in dir(plancc.Diagnostic) if not n.startswith("_")}
    assert issubclass(plancc.PlanError, Exception)


def test_materialize_refuses_to_leave_a_meta_buffer_it_cannot_recompute_as_garbage():
    import pytest
    import torch
    from torch import nn

    class Scaled(nn.Module):  # not a transformers model: nothing knows how to rebuild `scale`
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ValueError, match=r"buffers scale were created on the meta device"):
        plancc.materialize(model, "cpu")
    # built with real buffers (as plancc.models.build_model does), it is carried over
    model = Scaled().to_empty(device="meta")
    model.register_buffer("scale", torch.tensor(2.0), persistent=False)
    assert plancc.materialize(model, "cpu").scale.item() == 2.0


def test_parallelize_explains_which_mesh_it_needs():
    from .conftest import PLANS
    from .distributed import launch
    from .numerics_worker import parallelize_with_foreign_meshes

    errors = launch(parallelize_with_foreign_meshes, 1, str(PLANS / "qwen3.yaml"))[0]
    assert all(e and "takes the mesh plancc.build_mesh returns" in e and "('dp', 'cp', 'tp')" in e for e in errors), errors
    assert "an unnamed DeviceMesh of shape (1,)" in errors[0]
    assert "a DeviceMesh with axes ('dp_shard', 'tp') of sizes (1, 1)" in errors[2]


def test_a_model_built_on_meta_skips_its_weight_init_and_keeps_its_buffers_real():
    """Weight init writes values a meta tensor cannot hold, through torch's Python reference
    kernels: more than half of a meta build's time before ``build_model`` skipped those writes.
    Buffers (rotary frequencies) are built for real and still computed; a CPU build still inits."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from plancc.models import build_model, load_config

    class MetaWrites(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.split("::")[-1].endswith("_") and args and getattr(args[0], "is_meta", False):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    config = load_config("tiny-qwen3")
    with MetaWrites() as writes:
        model = build_model(config)
    assert not writes.ops, writes.ops[:5]
    assert all(p.is_meta for p in model.parameters())
    cpu = build_model(config, device="cpu")
    assert torch.equal(model.model.rotary_emb.inv_freq, cpu.model.rotary_emb.inv_freq)
    std = cpu.model.layers[0].mlp.up_proj.weight.std().item()
    assert abs(std - config.initializer_range) < 0.2 * config.initializer_range  # transformers' normal init
