"""Which decoder layers a plan's pipeline stage globs name (``pipeline: stages:``): the
algorithm the check (``checks.pipeline``), the runtime's stage cutting (``engine.pipeline.pipeline_stages``) and
``explain --pp`` share. A glob's segment ``[a-b]`` of two numbers is the numeric range a..b
(``model.layers.[0-13]`` is layers 0 to 13), not a character class."""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from .globs import ModuleTree
from .plan import PipelineSpec

_RANGE = re.compile(r"^\[(\d+)-(\d+)\]$")


def decoder_layer_names(modules: Mapping[str, nn.Module]) -> list[str]:
    """The decoder layers' module names, in order: the children of the model's ``layers`` list."""
    for name, module in modules.items():
        if name.rsplit(".", 1)[-1] == "layers" and len(list(module.children())):
            return [f"{name}.{child}" for child, _ in module.named_children()]
    return []


def stage_glob_matches(tree: ModuleTree, pattern: str) -> tuple[str, ...]:
    """``tree.match`` with whole-segment numeric ranges ``[a-b]`` read as a..b."""
    segments = pattern.split(".")
    ranges = {i: (int(m[1]), int(m[2])) for i, s in enumerate(segments) if (m := _RANGE.match(s))}
    if not ranges:
        return tree.match(pattern)
    wild = ".".join("*" if i in ranges else s for i, s in enumerate(segments))
    found = []
    for name in tree.match(wild):
        parts = name.split(".")
        if all(parts[i].isdigit() and low <= int(parts[i]) <= high for i, (low, high) in ranges.items()):
            found.append(name)
    return tuple(found)


def layers_of_stages(modules: Mapping[str, nn.Module], spec: PipelineSpec) -> list[list[int]]:
    """The decoder layer indices each of the plan's stage globs matches, in stage order."""
    tree = ModuleTree(modules)
    names = decoder_layer_names(modules)
    position = {name: i for i, name in enumerate(names)}
    return [
        sorted({position[n] for pattern in globs for n in stage_glob_matches(tree, pattern) if n in position})
        for globs in spec.stages
    ]
