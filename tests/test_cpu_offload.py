"""FSDP CPU offload for training (``--cpu-offload``, ``Policy(cpu_offload=True)``): the parameter
shards, their gradients and AdamW's state in host memory. What it must be: the same training as
the unsharded model (``--verify``), its host memory stated in the run's memory line, and counted
where it lives by the pre-launch bound (host, not the GPU)."""

from __future__ import annotations

import pytest

from .conftest import PLANS, forked_cli

QWEN3 = PLANS / "qwen3.yaml"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_offloaded_run_trains_as_the_unsharded_model_and_states_what_it_offloads():
    code, out, err = forked_cli("apply", QWEN3, "--cpu-offload", "--verify", "--steps", 2)
    assert code == 0, err + out
    assert "verify: OK" in out
    code, out, err = forked_cli("apply", QWEN3, "--cpu-offload", "--steps", 1)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("memory:"))
    assert "FSDP CPU offload: " in line and "MiB a rank of parameter shards, gradients and AdamW state" in line


def test_the_memory_bound_puts_an_offloaded_runs_state_in_host_memory():
    """On a GPU the state leaves the device for the host: a GPU too small for the state but not
    for the logits fits with --cpu-offload; a host too small for the state refuses it, naming it."""
    from plancc.job.config import RunConfig
    from plancc.job.memory import memory_problems, need
    from plancc.layout import Layout
    from plancc.models import build_meta_model, load_config

    model, config = build_meta_model("tiny-qwen3"), load_config("tiny-qwen3")
    plain = RunConfig.of(plan="p.yaml", layout=Layout(dp=2), batch_size=4, seq_len=32)
    offloaded = RunConfig.of(plan="p.yaml", layout=Layout(dp=2), batch_size=4, seq_len=32, cpu_offload=True)
    on_gpu, off_gpu = (need(c, model, config, longest=None, from_folder=True) for c in (plain, offloaded))
    assert off_gpu.state == on_gpu.state and off_gpu.device == on_gpu.device - on_gpu.state
    kw = {"local_ranks": 2, "longest": None, "from_folder": True, "device": "cuda"}
    gpu = on_gpu.logits + on_gpu.state // 2  # the logits fit, the state does not
    assert memory_problems(plain, model, config, gpu=gpu, host=1 << 40, **kw)
    assert memory_problems(offloaded, model, config, gpu=gpu, host=1 << 40, **kw) == []
    (host,) = memory_problems(offloaded, model, config, gpu=gpu, host=on_gpu.state, **kw)
    assert host.rule == "memory" and "--cpu-offload keeps" in host.message and "host memory" in host.message


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offload_under_pipeline_stages_trains_as_the_unsharded_model():
    """Each stage's shards in host memory (FSDP2's CPU offload on every stage, as on a whole
    model): ``--verify`` at pp2, and the memory line states the rank's offloaded MiB."""
    code, out, err = forked_cli("apply", QWEN3, "--pp", 2, "--cpu-offload", "--verify", "--steps", 2)
    assert code == 0 and "verify: OK" in out, err + out
    code, out, err = forked_cli("apply", QWEN3, "--pp", 2, "--cpu-offload", "--steps", 1)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("memory:"))
    assert "FSDP CPU offload: " in line and "MiB a rank of parameter shards" in line
