"""Flows traced before, for models built from equal configs.

Tracing a model's wiring runs its forward on meta tensors: about a second for an 8B-class
config of 36 layers, most of every ``check_plan`` call. A process that checks many plans
against one model (a notebook trying edits, ``plancc rules``' examples, a sweep over plans)
traces it once. Only models that ``check_plan`` built itself from a config are keyed this
way: a model the caller hands in may differ from its config's (modules replaced), so its
flow is traced from the model."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn

from ..dataflow import Flow, recorded_flow, remember

_KEPT = 8  # configs; a flow of a 61-layer MoE is a few MB of names
_flows: OrderedDict[tuple[str, str], Flow] = OrderedDict()


def _key(config: Any) -> tuple[str, str] | None:
    try:
        return f"{type(config).__module__}.{type(config).__qualname__}", config.to_json_string(use_diff=False)
    except Exception:  # a config that does not serialize is traced every time, as before
        return None


def attach(model: nn.Module, config: Any) -> None:
    """Give ``model`` (built from ``config``) the flow traced for an equal config, if any."""
    key = _key(config)
    if key is not None and key in _flows:
        _flows.move_to_end(key)
        remember(model, _flows[key])


def keep(model: nn.Module, config: Any) -> None:
    """Keep the flow a check traced on ``model`` (built from ``config``) for the next one."""
    flow, key = recorded_flow(model), _key(config)
    if flow is None or key is None:
        return
    _flows[key] = flow
    _flows.move_to_end(key)
    while len(_flows) > _KEPT:
        _flows.popitem(last=False)
