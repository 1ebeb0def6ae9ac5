"""Skeletons of the built-in presets: what ``plancc validate`` needs of a model, without
importing transformers' modeling code.

Checking a plan needs the module tree (names, classes, which modules are linear, embedding
or norm layers, which run a forward of their own), every parameter's shape and tying, the
attributes the checks read (``layer_idx``), the config with transformers' defaults filled
in, and which module outputs feed which modules (``plancc.dataflow``, one meta forward).
Building a Hugging Face model for that costs ~2.5 s of imports and initialization on a laptop,
paid on every ``validate`` and by every commit through the pre-commit hook. So each
preset's tree is recorded once, with the pinned transformers, and shipped
(``plancc/presets/skeletons/*.json``, written by ``python -m plancc.skeleton``); a skeleton is
an ``nn.Module`` tree on the meta device with the same names, class names, torch base classes,
parameters and ties, which the checks take as they take the real model.

``tests/test_skeleton.py`` pins that each shipped skeleton is what the pinned transformers
builds, and that validating on it reports exactly what validating on the real model does. A
skeleton cannot run (its forward raises): anything that runs a model (``--dry-run``, ``apply``'s
workers) builds the real one.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .dataflow import Flow, remember, trace
from .models import build_meta_model, load_config, presets
from .sequence_mixing import RECORDED_INTERFACE, RECORDED_MIXING, calls_attention_interface, sequence_mixing

# 2: the forward's wiring (plancc.dataflow) recorded; 3: how each module is called; 4: what the
# context-parallel check reads of each class's code (the attention interface, sequence mixing);
# 5: the config class's attribute aliases (Qwen3-MoE's ``num_experts`` is ``num_local_experts``)
FORMAT = 5

# torch classes a skeleton module may derive from, most specific first: the checks ask
# isinstance() of these (module kinds), and of nothing else
_BASES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.ModuleList, nn.Module)
_ATTRIBUTES = ("layer_idx",)  # plain attributes the checks read (CP: attention modules)


class SkeletonConfig:
    """A model config as transformers filled it in (``to_dict()`` of the real one): the
    attributes the checks and the preflight read, for a text-only decoder. ``aliases``: the
    config class's ``attribute_map`` (another name for a field, as the real config answers it)."""

    def __init__(self, fields: dict[str, Any], aliases: dict[str, str] | None = None):
        self.__dict__.update(fields)
        self._fields = dict(fields)
        self._aliases = dict(aliases or {})

    def __getattr__(self, name: str) -> Any:  # only for names that are not fields
        aliases = self.__dict__.get("_aliases", {})
        if name in aliases:
            return getattr(self, aliases[name])
        raise AttributeError(name)

    def get_text_config(self, *_args: Any, **_kwargs: Any) -> SkeletonConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(self._fields)

    def __repr__(self) -> str:
        return f"SkeletonConfig({self._fields.get('model_type')!r})"


def _own_forward(cls: type) -> bool:
    return cls.forward is not nn.Module.forward  # type: ignore[attr-defined]


def describe(model: nn.Module, config: Any) -> dict[str, Any]:
    """The record of a built model that ``build_skeleton`` rebuilds (JSON-ready)."""
    owner: dict[int, str] = {}  # id of a parameter -> the first qualified name holding it
    modules = []
    for name, module in model.named_modules():
        cls = type(module)
        base = next(b for b in _BASES if isinstance(module, b))
        params: dict[str, Any] = {}
        for pname, param in module._parameters.items():
            if param is None:
                continue
            fqn = f"{name}.{pname}" if name else pname
            if id(param) in owner:
                params[pname] = {"tied": owner[id(param)]}
                continue
            owner[id(param)] = fqn
            params[pname] = {"shape": list(param.shape), "dtype": str(param.dtype).removeprefix("torch.")}
        buffers = {
            bname: {
                "shape": list(buf.shape),
                "dtype": str(buf.dtype).removeprefix("torch."),
                "persistent": bname not in module._non_persistent_buffers_set,
            }
            for bname, buf in module._buffers.items()
            if buf is not None
        }
        attrs = {a: getattr(module, a) for a in _ATTRIBUTES if isinstance(getattr(module, a, None), int)}
        attrs[RECORDED_INTERFACE] = calls_attention_interface(module)
        attrs[RECORDED_MIXING] = sequence_mixing(module)
        modules.append(
            {
                "name": name,
                "class": cls.__name__,
                "base": base.__name__,
                "torch": cls is base,
                "forward": _own_forward(cls),
                "attributes": attrs,
                "parameters": params,
                "buffers": buffers,
            }
        )
    names = {id(m): n for n, m in model.named_modules()}
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    inputs = get_in() if callable(get_in) else None
    outputs = get_out() if callable(get_out) else None
    return {
        "format": FORMAT,
        "config": json.loads(json.dumps(config.to_dict(), default=str)),
        "aliases": dict(getattr(type(config), "attribute_map", {}) or {}),
        "input_embeddings": names.get(id(inputs)) if inputs is not None else None,
        "output_embeddings": names.get(id(outputs)) if outputs is not None else None,
        "modules": modules,
        "flow": trace(model).to_json(),
    }


def _skeleton_forward(self: nn.Module, *_args: Any, **_kwargs: Any) -> Any:
    raise NotImplementedError(f"{type(self).__name__} is a plancc skeleton (shapes only): build the real model to run")


@cache
def _class(name: str, base_name: str, is_torch: bool, forward: bool) -> type[nn.Module]:
    base = next(b for b in _BASES if b.__name__ == base_name)
    if is_torch:
        return base
    body: dict[str, Any] = {"__module__": "plancc.skeleton"}
    if forward:
        body["forward"] = _skeleton_forward
    elif _own_forward(base):  # a container deriving from a layer class: keep nn.Module's (none)
        body["forward"] = nn.Module.forward
    return type(name, (base,), body)


def _bare(cls: type[nn.Module]) -> nn.Module:
    module = cls.__new__(cls)
    nn.Module.__init__(module)  # no layer constructor: parameters come from the record
    return module


def build_skeleton(record: dict[str, Any]) -> nn.Module:
    """The meta-device module tree of ``record`` (see ``describe``), with ``config``,
    ``get_input_embeddings`` and ``get_output_embeddings`` on the root like a transformers
    model."""
    built: dict[str, nn.Module] = {}
    params: dict[str, nn.Parameter] = {}
    for entry in record["modules"]:
        module = _bare(_class(entry["class"], entry["base"], entry["torch"], entry["forward"]))
        name = entry["name"]
        for attr, value in entry["attributes"].items():
            module.__dict__[attr] = value  # plain attributes (nn.Module registers only tensors and modules)
        for pname, spec in entry["parameters"].items():
            fqn = f"{name}.{pname}" if name else pname
            if "tied" in spec:
                param = params[spec["tied"]]
            else:
                param = nn.Parameter(torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device="meta"))
            params[fqn] = param
            module.register_parameter(pname, param)
        for bname, spec in entry["buffers"].items():
            buf = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device="meta")
            module.register_buffer(bname, buf, persistent=spec["persistent"])
        if name:
            parent, _, leaf = name.rpartition(".")
            built[parent].add_module(leaf, module)
        built[name] = module
    root = built[""]
    root.config = SkeletonConfig(record["config"], record["aliases"])  # type: ignore[assignment]
    inputs, outputs = record["input_embeddings"], record["output_embeddings"]
    root.get_input_embeddings = lambda: built[inputs] if inputs is not None else None  # type: ignore[assignment]
    root.get_output_embeddings = lambda: built[outputs] if outputs is not None else None  # type: ignore[assignment]
    remember(root, Flow.from_json(record["flow"]))
    return root


@cache
def _record(preset: str) -> dict[str, Any] | None:
    entry = resources.files("plancc").joinpath("presets", "skeletons", f"{preset}.json")
    if not entry.is_file():
        return None
    record: dict[str, Any] = json.loads(entry.read_text())
    return record if record.get("format") == FORMAT else None


def load_skeleton(preset: str) -> tuple[SkeletonConfig, nn.Module] | None:
    """(config, meta module tree) of a built-in preset from its shipped skeleton, or None
    when it has none. A new tree on every call (callers may attach hooks)."""
    record = _record(preset)
    if record is None:
        return None
    model = build_skeleton(record)
    return model.config, model  # type: ignore[return-value]


def write_skeletons(folder: str | None = None) -> list[str]:
    """Record every preset with the installed transformers (``python -m plancc.skeleton``)."""
    target = Path(folder) if folder else Path(__file__).parent / "presets" / "skeletons"
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name in presets():
        config = load_config(name)
        if config.get_text_config() is not config:  # multimodal wrappers: the real model only
            continue
        record = describe(build_meta_model(config), config)
        text = json.dumps(record, separators=(",", ":"))  # not sorted: key order is parameter order
        (target / f"{name}.json").write_text(text + "\n")
        written.append(name)
    return written


if __name__ == "__main__":
    print("wrote skeletons of", ", ".join(write_skeletons(sys.argv[1] if len(sys.argv) > 1 else None)))
