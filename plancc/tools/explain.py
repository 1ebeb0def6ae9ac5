"""``plancc explain``: what the plan does to every parameter, and what each rank holds.

For every module group (repeated layers folded into one ``model.layers.*`` row): its style,
each parameter's global shape, the shard rank 0 holds after TP and then FSDP over the
dp*cp ranks, and the placements. Per-rank bytes of parameters, gradients and AdamW state
follow from those shards (fp32 master weights, as FSDP mixed precision keeps them); the
dry run measures the same numbers on the real parallelized model.

With a ``lora:`` section the adapters get rows of their own (``lora_A`` / ``lora_B``, placed
as ``checks.lora_targets`` says), and only they hold gradients and AdamW state: the base is
frozen.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from torch import nn

from ..compiler.adapted_modules import adapted_modules
from ..compiler.adapter_layouts import ADAPTER_PLACEMENTS, adapter_layout
from ..compiler.globs import generalize
from ..compiler.lora_spec import LoraSpec
from ..compiler.plain_placements import Placement, Replicate, Shard
from ..compiler.resolve import ResolvedPlan
from ..compiler.styles import canonical_style, format_layout, module_kind, style_layouts
from ..layout import Layout

FP32 = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamRow:
    group: str
    count: int
    style: str
    param: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    tp_placement: str
    fsdp_placement: str
    trainable: bool = True  # False: a frozen base parameter under LoRA (no gradient, no state)

    @property
    def local_bytes(self) -> int:
        return math.prod(self.local_shape) * FP32 * self.count


@dataclass(frozen=True, kw_only=True, slots=True)
class Explanation:
    rows: tuple[ParamRow, ...]
    tp: int
    fsdp_ranks: int

    @property
    def param_bytes(self) -> int:
        return sum(r.local_bytes for r in self.rows)

    @property
    def grad_bytes(self) -> int:
        return sum(r.local_bytes for r in self.rows if r.trainable)

    @property
    def optimizer_bytes(self) -> int:
        return 2 * self.grad_bytes

    def as_dict(self) -> dict:
        return {
            "tp": self.tp,
            "fsdp_ranks": self.fsdp_ranks,
            "per_rank_bytes": {
                "parameters": self.param_bytes,
                "gradients": self.grad_bytes,
                "adamw_state": self.optimizer_bytes,
                "total": self.param_bytes + self.grad_bytes + self.optimizer_bytes,
            },
            "rows": [
                {
                    "module": r.group,
                    "count": r.count,
                    "style": r.style,
                    "param": r.param,
                    "global_shape": list(r.global_shape),
                    "local_shape": list(r.local_shape),
                    "tp": r.tp_placement,
                    "fsdp": r.fsdp_placement,
                    "trainable": r.trainable,
                }
                for r in self.rows
            ],
        }


def _chunk(n: int, parts: int) -> int:
    """The largest (rank 0's) piece of torch.chunk-style sharding."""
    return -(-n // parts) if parts > 1 else n


@functools.lru_cache(maxsize=65536)
def _group(name: str) -> str:
    return generalize(name)  # a module name's row (layer indices folded): the same for every layout


@dataclass(frozen=True, slots=True)
class TensorParallelRows:
    """Each row's shard after TP (and EP) alone, before FSDP: the part of ``explain`` that
    depends on tp, ep and the plan's section, not on how many ranks FSDP shards over (``plancc
    suggest`` costs dozens of layouts that differ only in that). ``spread``: per row, whether
    FSDP shards it over the expert FSDP ranks (experts under ep) rather than dp*cp."""

    rows: tuple[ParamRow, ...]
    spread: tuple[bool, ...]


def explain(
    model: nn.Module,
    resolved: ResolvedPlan | None,
    layout: Layout,
    lora: LoraSpec | None = None,
    *,
    tensor_parallel: TensorParallelRows | None = None,
) -> Explanation:
    """``tensor_parallel``: this layout's ``tensor_parallel_rows``, when the caller kept them."""
    before = tensor_parallel or tensor_parallel_rows(model, resolved, layout, lora)
    rows = []
    for row, spread in zip(before.rows, before.spread, strict=True):
        shards = layout.expert_fsdp_size if spread else layout.fsdp_size
        if shards > 1:
            shape = (_chunk(row.local_shape[0], shards), *row.local_shape[1:]) if row.local_shape else ()
            where = f"shard(0) over {shards}" if spread else "shard(0)"
            row = replace(row, local_shape=shape, fsdp_placement=where)
        rows.append(row)
    return Explanation(rows=tuple(rows), tp=layout.tp, fsdp_ranks=layout.fsdp_size)


def tensor_parallel_rows(
    model: nn.Module, resolved: ResolvedPlan | None, layout: Layout, lora: LoraSpec | None = None
) -> TensorParallelRows:
    """Every parameter's row with its shard after TP/EP (``fsdp_placement`` still "-")."""
    tp = layout.tp
    frozen = lora is not None
    rows: dict[tuple[str, str], ParamRow] = {}
    spreads: dict[tuple[str, str], bool] = {}
    counts: dict[tuple[str, str], int] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        rule = resolved.assignments.get(name) if resolved is not None else None
        # with ep, experts spread over ep*tp ranks and FSDP over the dp/ep ranks left
        spread = layout.ep > 1 and rule is not None and canonical_style(rule.style.name).name == "moe_experts"
        if tp == 1 and not spread:
            rule = None
        lay = style_layouts(rule.style) if rule else None
        split = layout.expert_ranks if spread else tp
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights are held once
                continue
            seen.add(id(param))
            placement: Placement = Replicate()
            if lay is not None and lay.weight is not None:
                placement = lay.weight.get(module_kind(module), Replicate())
                if p_name == "bias" and isinstance(placement, Shard):
                    # a colwise bias is sharded with the outputs; a rowwise bias is added after the reduce
                    placement = Shard(0) if placement.dim == 0 else Replicate()
            shape = list(param.shape)
            if isinstance(placement, Shard):
                shape[placement.dim] = _chunk(shape[placement.dim], split)
            key = (_group(name), p_name)
            if key in rows:  # a repeated layer's parameter: counted, its row made once at the end
                counts[key] += 1
            else:
                counts[key] = 1
                spreads[key] = spread
                style = rule.style.describe() if rule else "-"
                rows[key] = ParamRow(
                    group=key[0],
                    count=1,
                    style=style,
                    param=p_name,
                    global_shape=tuple(param.shape),
                    local_shape=tuple(shape),
                    tp_placement=(f"{format_layout(placement)} over ep*tp" if spread else format_layout(placement))
                    if split > 1
                    else "-",
                    fsdp_placement="-",
                    trainable=not frozen,
                )
    rows = {key: replace(row, count=counts[key]) if counts[key] > 1 else row for key, row in rows.items()}
    if lora is not None:
        _adapter_rows(model, resolved, layout, lora, rows)
    return TensorParallelRows(rows=tuple(rows.values()), spread=tuple(spreads.get(key, False) for key in rows))


def _adapter_rows(
    model: nn.Module,
    resolved: ResolvedPlan | None,
    layout: Layout,
    lora: LoraSpec,
    rows: dict[tuple[str, str], ParamRow],
) -> None:
    """A row for each adapted module group's ``lora_A`` and ``lora_B`` (trainable), sharded by TP."""
    modules = dict(model.named_modules())
    tp = layout.tp
    for name in adapted_modules(model, lora)[0]:
        weight = getattr(modules[name], "weight", None)
        if weight is None or weight.dim() != 2:
            continue  # checks.lora_targets reports it
        out_features, in_features = weight.shape
        kind = adapter_layout(name, resolved, tp)
        placements = ADAPTER_PLACEMENTS.get(kind, ADAPTER_PLACEMENTS[None])
        for param, global_shape, placement in (
            ("lora_A.weight", (lora.r, in_features), placements[0]),
            ("lora_B.weight", (out_features, lora.r), placements[1]),
        ):
            shape = list(global_shape)
            if isinstance(placement, Shard) and tp > 1:
                shape[placement.dim] = _chunk(shape[placement.dim], tp)
            key = (_group(name), param)
            old = rows.get(key)
            rows[key] = ParamRow(
                group=key[0],
                count=old.count + 1 if old else 1,
                style=f"lora r={lora.r}",
                param=param,
                global_shape=global_shape,
                local_shape=tuple(shape),
                tp_placement=format_layout(placement) if tp > 1 else "-",
                fsdp_placement="-",
            )


def human_bytes(n: int) -> str:
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.2f} {unit}"


def render(exp: Explanation) -> str:
    header = ["module", "n", "style", "param", "global shape", "rank-0 shard", "tp", "fsdp"]
    body = [
        [
            r.group,
            str(r.count),
            r.style,
            r.param,
            "x".join(map(str, r.global_shape)),
            "x".join(map(str, r.local_shape)),
            r.tp_placement,
            r.fsdp_placement,
        ]
        for r in exp.rows
    ]
    widths = [max(len(row[i]) for row in body + [header]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
    total = exp.param_bytes + exp.grad_bytes + exp.optimizer_bytes
    lines.append("")
    lines.append(
        f"per rank (fp32 master weights, FSDP over {exp.fsdp_ranks} ranks, tp={exp.tp}): "
        f"parameters {human_bytes(exp.param_bytes)}, gradients {human_bytes(exp.grad_bytes)}, "
        f"AdamW state {human_bytes(exp.optimizer_bytes)}, total {human_bytes(total)}"
    )
    if any(not r.trainable for r in exp.rows):
        trained = sum(r.local_bytes for r in exp.rows if r.trainable)
        lines.append(
            f"LoRA: the adapters ({human_bytes(trained)} per rank, {trained / max(exp.param_bytes, 1):.2%} of the "
            "parameters) train; the base is frozen: no gradient, no optimizer state"
        )
    return "\n".join(lines)
