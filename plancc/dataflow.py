"""Which module outputs flow into which modules and parameters: one forward of the model on
the meta device, recorded.

The module tree says what a model holds, not how its forward wires it: that an MLP's
activation (xIELU's learnable ``alpha_p``/``alpha_n``) reads ``up_proj``'s output, or that
Qwen3's ``q_norm`` reads ``q_proj``'s, is in the Python of ``forward``. A plan that shards
``up_proj`` colwise without a style for ``act_fn`` trains wrong (each rank forms the
activation's gradients from its shard of the features) though every shape fits, so the checks
need that wiring. It is recorded by running the model once on meta tensors (no memory, no
arithmetic), with a provenance set on every tensor:

- a *leaf* module (one with no submodules) marks its outputs with its own name;
- every other operation gives its outputs the union of its inputs' provenance, so residual
  adds, reshapes, masks and rotary products pass it on; integer and boolean outputs (top-k
  indices, masks built from them) carry none: they select tokens, they hold no features;
- each leaf call is recorded with the provenance of its inputs, and each parameter used by a
  non-leaf module directly (attention sinks, say) with the provenance of what it met;
- a leaf output that is split on its last dim as it comes out (``gate, up = gate_up_proj(x)
  .chunk(2, -1)``, or sliced as Phi-3 slices its ``qkv``) is recorded with the parts' widths:
  it is a packed projection, which plain colwise shards wrong.

Only the wiring is kept, not the tensors; skeletons of the built-in presets ship it
(``plancc.skeleton``), so validating a preset does not need transformers to run this.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

FLOW_ATTRIBUTE = "_plancc_flow"  # where a model (or a skeleton) carries its recorded flow
TRACE_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Read:
    """``reader`` (a leaf module's name, or a parameter's qualified name) took inputs computed
    from the outputs of the leaf modules ``sources``. ``params``: a leaf's own parameters."""

    reader: str
    sources: frozenset[str]
    params: tuple[str, ...] = ()

    def to_json(self) -> list[Any]:
        return [self.reader, sorted(self.sources), list(self.params)]

    @classmethod
    def from_json(cls, entry: list[Any]) -> Read:
        return cls(reader=entry[0], sources=frozenset(entry[1]), params=tuple(entry[2]))


@dataclass(frozen=True, slots=True)
class CallSignature:
    """How a module was called: its positional arguments, the names of its keyword arguments
    (in the order given), how many values it returned (a tuple's length, else 1), and the leaves
    its main input -- the first positional argument, or ``hidden_states=`` -- was computed from."""

    positional: int
    keywords: tuple[str, ...]
    outputs: int
    input_sources: frozenset[str] = frozenset()
    output_sources: frozenset[str] = frozenset()  # what its output was computed from (a residual: its input's)

    def to_json(self) -> list[Any]:
        sources = [sorted(self.input_sources), sorted(self.output_sources)]
        return [self.positional, list(self.keywords), self.outputs, *sources]

    @classmethod
    def from_json(cls, entry: list[Any]) -> CallSignature:
        positional, keywords, outputs, inputs, made_of = entry
        return cls(
            positional=positional,
            keywords=tuple(keywords),
            outputs=outputs,
            input_sources=frozenset(inputs),
            output_sources=frozenset(made_of),
        )


@dataclass(frozen=True, slots=True)
class Flow:
    calls: tuple[Read, ...]  # leaf-module calls, in the order the forward made them
    param_uses: tuple[Read, ...]  # parameters used directly by non-leaf modules
    # leaf -> the widths its output was split into on the last dim, in the order taken
    splits: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # leaf -> the leaves whose output it took as it came out (not a product of it)
    feeds: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # every module (not only leaves) -> how its first call looked: what prepare_input /
    # prepare_output lay out must fit it
    signatures: tuple[tuple[str, CallSignature], ...] = ()
    # lookups built on first use (the checks ask once per module, per layout: plancc suggest
    # checks a model at dozens of layouts); not part of the record
    _index: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def signature(self, name: str) -> CallSignature | None:
        if "signatures" not in self._index:
            self._index["signatures"] = dict(self.signatures)
        found: CallSignature | None = self._index["signatures"].get(name)
        return found

    def readers(self, source: str) -> list[str]:
        """The leaf calls that read ``source``'s output, in call order."""
        if "readers" not in self._index:
            index: dict[str, list[str]] = {}
            for call in self.calls:
                for read in call.sources:
                    index.setdefault(read, []).append(call.reader)
            self._index["readers"] = index
        readers: list[str] = self._index["readers"].get(source, [])
        return readers

    def to_json(self) -> dict[str, Any]:
        return {
            "calls": [r.to_json() for r in self.calls],
            "param_uses": [r.to_json() for r in self.param_uses],
            "splits": {name: list(parts) for name, parts in self.splits},
            "feeds": {name: list(producers) for name, producers in self.feeds},
            "signatures": {name: sig.to_json() for name, sig in self.signatures},
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Flow:
        return cls(
            calls=tuple(Read.from_json(e) for e in record["calls"]),
            param_uses=tuple(Read.from_json(e) for e in record["param_uses"]),
            splits=tuple((name, tuple(parts)) for name, parts in record.get("splits", {}).items()),
            feeds=tuple((name, tuple(producers)) for name, producers in record.get("feeds", {}).items()),
            signatures=tuple(
                (name, CallSignature.from_json(entry)) for name, entry in record.get("signatures", {}).items()
            ),
        )


_SPLITS = {
    torch.chunk,
    torch.split,
    torch.tensor_split,
    torch.Tensor.chunk,
    torch.Tensor.split,
    torch.Tensor.tensor_split,
}


def _last_dim_split(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> tuple[int, ...]:
    """The widths of the pieces ``func`` cut off its input's last dim (empty: not such a cut)."""
    source = args[0]
    if func in _SPLITS:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        if isinstance(dim, int) and dim in (-1, source.dim() - 1) and isinstance(out, (list, tuple)):
            return tuple(int(t.shape[-1]) for t in out)
    elif func is torch.Tensor.__getitem__ and isinstance(args[1], tuple) and args[1]:
        *before, last = args[1]
        cuts_last_dim = isinstance(last, slice) and last != slice(None)
        keeps_the_rest = all(b is Ellipsis or b == slice(None) for b in before)
        if cuts_last_dim and keeps_the_rest and (Ellipsis in before or len(args[1]) == source.dim()):
            return (int(out.shape[-1]),)
    return ()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors inside a forward's arguments or outputs (tuples, dicts, HF output classes)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):  # HF ModelOutput is a dict too
        for item in value.values():
            yield from _tensors(item)


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.provenance: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # ids stay unique while every marked tensor lives
        self.calls: list[Read] = []
        self.param_uses: list[Read] = []
        self.param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        # tensors made from parameters alone (``sinks.reshape(...).expand(...)``): which ones
        self.derived: dict[int, frozenset[str]] = {}
        self.in_leaf = 0
        self.outputs: dict[int, str] = {}  # a leaf's output tensors, as they came out
        self.splits: dict[str, tuple[int, ...]] = {}
        self.feeds: dict[str, tuple[str, ...]] = {}

    def of(self, value: Any) -> frozenset[str]:
        found: set[str] = set()
        for t in _tensors(value):
            found |= self.provenance.get(id(t), frozenset())
        return frozenset(found)

    def mark(self, value: Any, sources: frozenset[str]) -> None:
        for t in _tensors(value):
            if not (t.is_floating_point() or t.is_complex()):
                # indices and masks say which tokens or experts, not features computed from the
                # sources: a sparse-attention indexer's top-k picks tokens whatever its layout
                continue
            self.provenance[id(t)] = sources
            self.alive.append(t)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.in_leaf and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.outputs:
            parts = _last_dim_split(func, args, kwargs, out)
            if parts:
                leaf = self.outputs[id(args[0])]
                # slicing adds a piece at a time; one chunk/split gives them all
                self.splits[leaf] = parts if func in _SPLITS else self.splits.get(leaf, ()) + parts
        sources = self.of((args, kwargs))
        params = self.params_in((args, kwargs)) if not self.in_leaf else frozenset()
        if sources:
            # a parameter (or a reshaped view of one) meets activations here: its use
            for name in sorted(params):
                self.param_uses.append(Read(reader=name, sources=sources))
            self.mark(out, sources)
        elif params:
            for t in _tensors(out):
                self.derived[id(t)] = params
                self.alive.append(t)
        return out

    def params_in(self, value: Any) -> frozenset[str]:
        found: set[str] = set()
        for t in _tensors(value):
            if isinstance(t, nn.Parameter) and id(t) in self.param_names:
                found.add(self.param_names[id(t)])
            found |= self.derived.get(id(t), frozenset())
        return frozenset(found)


class TraceError(Exception):
    """The model's forward could not run on meta tensors."""


@contextmanager
def _buffers_on_meta(model: nn.Module) -> Iterator[None]:
    """A meta-built model keeps real buffers (``plancc.models.parameters_on_meta``); a forward
    on meta inputs must not meet them (DeepSeek's router adds its score-correction buffer)."""
    saved = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta]
    try:
        for module, name, buffer in saved:
            module._buffers[name] = buffer.to("meta")
        yield
    finally:
        for module, name, buffer in saved:
            module._buffers[name] = buffer


@contextmanager
def batched_experts(model: nn.Module) -> Iterator[None]:
    """transformers' default experts kernel (``grouped_mm``) takes no fp32 on meta and no fp64
    at all, and its eager loop asks ``nonzero`` (no meta kernel); ``batched_mm`` reads the same
    weights and inputs (same wiring, same values) with plain batched matmuls."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    saved = {key: c._experts_implementation for key, c in configs.items() if hasattr(c, "_experts_implementation")}
    try:
        for key in saved:
            configs[key]._experts_implementation = "batched_mm"
        yield
    finally:
        for key, value in saved.items():
            configs[key]._experts_implementation = value


def trace(model: nn.Module) -> Flow:
    """Run ``model`` once on meta ``input_ids`` and record its wiring (see the module doc)."""
    recorder = _Recorder(model)
    handles = []

    def before(name: str, module: nn.Module) -> Any:
        own = tuple(n for n, p in module.named_parameters(recurse=False) if p is not None)

        def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
            recorder.calls.append(Read(reader=name, sources=recorder.of((args, kwargs)), params=own))
            whole = tuple(recorder.outputs[id(t)] for t in _tensors((args, kwargs)) if id(t) in recorder.outputs)
            if whole:
                recorder.feeds[name] = tuple(dict.fromkeys(recorder.feeds.get(name, ()) + whole))
            recorder.in_leaf += 1

        return hook

    def after(name: str) -> Any:
        def hook(_m: nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
            recorder.in_leaf -= 1
            recorder.mark(output, frozenset({name}))
            if isinstance(output, torch.Tensor):
                recorder.outputs[id(output)] = name

        return hook

    signatures: dict[str, CallSignature] = {}

    def called(name: str) -> Any:
        def hook(_m: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            outputs = len(output) if isinstance(output, tuple) else 1
            main = args[0] if args else kwargs.get("hidden_states")
            signatures.setdefault(
                name,
                CallSignature(
                    positional=len(args),
                    keywords=tuple(kwargs),
                    outputs=outputs,
                    input_sources=recorder.of(main) if isinstance(main, torch.Tensor) else frozenset(),
                    output_sources=recorder.of(output),
                ),
            )

        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(called(name), with_kwargs=True))
        if next(module.children(), None) is None:
            handles.append(module.register_forward_pre_hook(before(name, module), with_kwargs=True))
            handles.append(module.register_forward_hook(after(name), with_kwargs=True))
    ids = torch.zeros(1, TRACE_TOKENS, dtype=torch.long, device="meta")
    try:
        with recorder, torch.no_grad(), batched_experts(model), _buffers_on_meta(model):
            model(input_ids=ids)
    except Exception as exc:  # any failure of a third-party forward on meta tensors
        raise TraceError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for handle in handles:
            handle.remove()
    return Flow(
        calls=tuple(recorder.calls),
        param_uses=tuple(recorder.param_uses),
        splits=tuple(recorder.splits.items()),
        feeds=tuple(recorder.feeds.items()),
        signatures=tuple(signatures.items()),
    )


def recorded_flow(model: nn.Module) -> Flow | None:
    """The flow a model carries (skeletons ship theirs; ``trace`` results are kept here)."""
    flow = getattr(model, FLOW_ATTRIBUTE, None)
    return flow if isinstance(flow, Flow) else None


def remember(model: nn.Module, flow: Flow) -> None:
    object.__setattr__(model, FLOW_ATTRIBUTE, flow)  # a plain attribute, not a submodule
