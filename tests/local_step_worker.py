"""Ranks for tests/test_local_step.py: the same Policy trained twice from the same weights, its
optimizer stepped on the local shards (plancc's way) and through DTensor's dispatch."""

from __future__ import annotations

from .distributed import init_gloo, sized
from .policy_worker import ROWS_PER_RANK, global_batch, nll

OPTIMIZERS = {
    "adamw": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.1}},
    "adamw-scheduled": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.1}},
    "adamw-fused": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "fused": True}},
    "sgd-momentum": {"name": "torch.optim.SGD", "kwargs": {"lr": 1e-2, "momentum": 0.9, "nesterov": True}},
}


def _state(policy):
    """Every parameter's full value and every optimizer state entry, as plain tensors."""
    from torch.distributed.tensor import DTensor

    def plain(value):
        return value.full_tensor() if isinstance(value, DTensor) else value

    names = {id(p): n for n, p in policy.model.named_parameters()}
    state = {}
    for param, held in policy.optimizer.state.items():
        for key, value in held.items():
            kept_as = "dtensor" if isinstance(value, DTensor) else "tensor"
            state[f"{names[id(param)]}/{key}"] = (kept_as, plain(value).detach().clone())
    params = {n: plain(p).detach().clone() for n, p in policy.model.named_parameters()}
    return params, state


# a schedule wraps the optimizer's step on the instance: the local way must still step the shards
SCHEDULES = {"adamw-scheduled": {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.5}}}


def both_ways(plan, model_name, layout, optimizer):
    import warnings

    import torch
    from torch.distributed.tensor import DTensor

    import plancc
    from plancc.models import load_config
    from plancc.runtime import local_step

    init_gloo()
    batch = global_batch(ROWS_PER_RANK * 2, load_config(model_name).vocab_size, seed=7)
    found = {}
    elementwise = local_step.ELEMENTWISE
    kind = torch.optim.SGD if optimizer.startswith("sgd") else torch.optim.AdamW
    own_step, on_dtensors = kind.step, []

    def recording(self, *args, **kwargs):  # what each step of the optimizer's class was given
        on_dtensors.append(isinstance(self.param_groups[0]["params"][0], DTensor))
        return own_step(self, *args, **kwargs)

    kind.step = recording
    for way in ("local", "dtensor"):
        local_step.ELEMENTWISE = elementwise if way == "local" else ()
        on_dtensors.clear()
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            policy = plancc.Policy(plan, model_name, optimizer=OPTIMIZERS[optimizer], max_grad_norm=None,
                                   lr_scheduler=SCHEDULES.get(optimizer), layout=sized(**layout))
            mine = {k: v[policy.slice_of(batch["input_ids"].shape[0])] for k, v in batch.items()}
            for _ in range(3):
                policy.train(mine, nll)
        found[way] = _state(policy)
        found[way + "_twins"] = len(local_step._TWINS)
        found[way + "_steps_on_dtensors"] = list(on_dtensors)
        found[way + "_schedule_warned"] = any("lr_scheduler.step()" in str(w.message) for w in warned)
    kind.step = own_step
    local_step.ELEMENTWISE = elementwise
    (params, state), (want_params, want_state) = found["local"], found["dtensor"]
    torch.distributed.destroy_process_group()
    return {
        "params_bitwise": sorted(params) == sorted(want_params)
        and all(torch.equal(params[k], want_params[k]) for k in want_params),
        "moved": sum(p.numel() for p in params.values()),
        "state_keys_equal": sorted(state) == sorted(want_state),
        "state_bitwise": all(torch.equal(state[k][1], want_state[k][1]) for k in want_state),
        "kept_as": sorted({state[k][0] + ":" + k.rsplit("/", 1)[1] for k in state}),
        "want_kept_as": sorted({want_state[k][0] + ":" + k.rsplit("/", 1)[1] for k in want_state}),
        "twins": (found["local_twins"], found["dtensor_twins"]),
        "steps_on_dtensors": (found["local_steps_on_dtensors"], found["dtensor_steps_on_dtensors"]),
        "schedule_warned": (found["local_schedule_warned"], found["dtensor_schedule_warned"]),
    }
