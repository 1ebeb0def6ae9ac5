"""Every rank agrees on a step's batch before it runs and on its outcome after (``plancc.Policy``):
one all-gather of each rank's verdict on its own slice, its rows' fingerprint and counts
(``agreed_batch``: the global batch's ``BatchTotals`` and as many microbatches on every rank), and after
the last backward one fixed-size all-reduce of the verdicts and the metric names' fingerprint,
then the loss and metrics by name (``settled_step``). A problem on one rank is every rank's
``BatchError``, naming the rank: no rank goes on to a collective the others skip."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.mesh import ParallelMesh
from ..runtime.non_finite import first_non_finite
from .batches import (
    Batch,
    BatchError,
    RowSpan,
    check_batch,
    default_token_mask,
    from_host,
    plan_microbatches,
    row_spans,
    split_to_count,
)
from .loss_contract import BatchTotals, NonFiniteError
from .refit_agreement import first_problem

FINGERPRINT_MODULUS = 2**52  # a batch fingerprint below it is exact in the float64 verdicts gathered


@dataclass(frozen=True, slots=True)
class AgreedBatch:
    """A step's batch once every rank agreed on it (``agreed_batch``)."""

    batch: dict[str, torch.Tensor]  # every field, on the policy's device
    totals: BatchTotals  # the global batch's normalizers
    microbatches: list[list[int]]  # this rank's rows, cut: as many cuts as on every other dp rank
    spans: list[RowSpan]  # every row's, read where the caller's rows were (the host for a CPU batch)
    # every attended token of the global batch, prompts included, padding not: what a step's
    # throughput counts, as torchtitan's tokens/s does (``totals.tokens`` counts what the loss counts)
    input_tokens: float


def agreed_batch(
    batch: Batch,
    mesh: ParallelMesh,
    *,
    device: str,
    vocab_size: int | None,
    micro_batch_size: int | None,
    max_tokens: int | None,
) -> AgreedBatch:
    """The batch on this device, the global batch's ``BatchTotals``, this rank's microbatches and
    its rows' spans, once every rank has found its own slice usable, the dp ranks hold as many rows (a global batch
    split evenly: ``slice_of``) and the ranks of one tp / cp group the same ones (a
    fingerprint of the rows compared); the same ``BatchError`` on every rank otherwise,
    naming the rank or the ranks. Every rank plans as many microbatches as the dp rank with
    the most (collectives line up). One all-gather over every rank for all of it: each rank
    sees every rank's verdict and counts, so each raises, or goes on, alike."""
    problem = ""
    try:
        check_batch(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens, vocab_size=vocab_size)
    except BatchError as exc:
        problem = str(exc)
    on_device: dict[str, torch.Tensor] = {}
    plan: list[list[int]] = []
    spans: list[RowSpan] = []
    # The verdict is counted where the rows are (a caller's CPU batch: no read of the device, so
    # the GPU runs the last step's optimizer while this step is planned), then copied without
    # a wait for the device's queue; only the gather over several ranks reads the device.
    where = batch["input_ids"].device if not problem else torch.device("cpu")
    mine = torch.zeros(10, dtype=torch.float64, device=where)
    if problem:
        mine[0] = 1
    else:
        on_device = {name: value.to(device, non_blocking=True) for name, value in batch.items()}
        # every field beside the rows' ids (a caller may mix devices: each was copied to ``device``)
        beside = {name: value.to(where) for name, value in batch.items() if name != "input_ids"}
        ids, mask = batch["input_ids"], beside["attention_mask"]
        lengths = mask.sum(1).tolist()  # every row's attended tokens, on the host
        plan = plan_microbatches(lengths, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
        spans = row_spans(mask)  # for cutting and packing the microbatches: read here, not on the device
        token_mask, sample_mask = beside.get("token_mask"), beside.get("sample_mask")
        weights = torch.arange(1, ids.numel() + 1, device=where).reshape(ids.shape)
        # the same rows give the same numbers: int64 sums (wrapping is fine for a
        # fingerprint), kept below 2^52 so that float64 holds them exactly, each converted
        # on its own -- stacked with a float mask's sum they would be promoted to float32
        # and the "different rows" check below would stop seeing differences
        counts = [
            torch.tensor(ids.shape[0], device=where),
            (ids.long() * weights).sum() % FINGERPRINT_MODULUS,
            (mask.long() * weights).sum() % FINGERPRINT_MODULUS,
            torch.tensor(ids.shape[1], device=where),
            (token_mask if token_mask is not None else default_token_mask(mask)).sum(),
            sample_mask.sum() if sample_mask is not None else torch.tensor(ids.shape[0], device=where),
            torch.tensor(len(plan), device=where),
            torch.tensor(sum(lengths), device=where),
            fields_fingerprint(batch, where),
        ]
        mine[1:] = torch.stack([count.to(torch.float64) for count in counts])
    if dist.get_world_size() == 1:  # a group of one: its own verdict, no collective
        verdicts = [mine.tolist()]
    else:
        mine = mine.to(device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        verdicts = torch.stack(every).tolist()
    if any(v[0] for v in verdicts):  # a rank's own slice is unusable: its words, gathered now
        agree(partial(raise_if, problem), device)
    assert (mesh.device_mesh.mesh_dim_names or ("",))[0] in ("dp", "dp_replicate"), "the (dp, cp, tp) mesh: dp first"
    ranks = mesh.device_mesh.mesh.reshape(mesh.layout.dp, -1).tolist()  # each dp rank's replicas
    sizes = [int(verdicts[group[0]][1]) for group in ranks]
    if len(set(sizes)) > 1:
        raise BatchError(
            f"the dp ranks hold {sizes} rows: a global batch splits into equal slices over dp={mesh.layout.dp} "
            "(pass rows policy.slice_of(global_rows) on each rank)"
        )
    for group in ranks:
        if any(verdicts[r][1:5] != verdicts[group[0]][1:5] for r in group):
            raise BatchError(
                f"the ranks {group} of one tp / cp group were given different rows: they must pass the same "
                "rows, full length (the engine shards the sequence for cp itself)"
            )
        if any(verdicts[r][9] != verdicts[group[0]][9] for r in group):
            raise BatchError(different_fields(group, batch))
    shares = [verdicts[group[0]] for group in ranks]  # one per dp rank
    norm = BatchTotals(tokens=sum(v[5] for v in shares), sequences=sum(v[6] for v in shares))
    spread = split_to_count(plan, int(max(v[7] for v in shares)))
    # every dp rank holds as many rows (checked above) and no rank plans more microbatches than
    # it has rows, so splitting always reaches the count: no rank runs an empty pass (whose
    # ``0 * log-prob`` backward would be NaN wherever a log-prob is -inf)
    assert all(spread), "equal rows per dp rank split into as many microbatches on every rank"
    return AgreedBatch(
        batch=on_device, totals=norm, microbatches=spread, spans=spans, input_tokens=sum(v[8] for v in shares)
    )


def fields_fingerprint(batch: Batch, where: torch.device | str) -> torch.Tensor:
    """Every field beside the rows' ids in one number (its name and its bits, wrapping below 2^52):
    the ranks that compute one set of rows must hand the loss the same advantages, masks and
    rewards, or its gradients are some mix of each rank's."""
    total = torch.zeros((), dtype=torch.long, device=where)
    for name in sorted(batch):
        if name == "input_ids":
            continue
        value = batch[name].to(where).contiguous()
        bits = value.to(torch.uint8) if value.dtype == torch.bool else value
        if bits.is_floating_point() or bits.is_complex():
            bits = bits.view(_SAME_WIDTH_INT[bits.element_size()])  # the exact bits, not a rounded sum
        bits = bits.long().flatten()
        weights = torch.arange(1, bits.numel() + 1, device=where)
        total = total + zlib.crc32(name.encode()) + (bits * weights).sum() % FINGERPRINT_MODULUS
    return total % FINGERPRINT_MODULUS


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def different_fields(group: Sequence[int], batch: Batch) -> str:
    fields = ", ".join(sorted(n for n in batch if n != "input_ids"))
    return (
        f"the ranks {group} of one tp / cp / pipeline group were given the same rows but different values of "
        f"their other fields ({fields}): the loss reads them alike on every rank that computes those rows; pass "
        "each field as the rows' slice of the global batch (policy.slice_of) on every rank of the group"
    )


def agree(check: Callable[[], Any], device: str) -> Any:
    """``check()`` on every rank; when it raised on any, a ``BatchError`` on every rank that
    names the first rank's problem (no rank goes on to a collective the others skip)."""
    problem = ""
    result = None
    try:
        result = check()
    except BatchError as exc:
        problem = str(exc)
    found = first_problem(problem, device)
    if found is not None:
        rank, first = found
        raise BatchError(f"rank {rank}: {first}")
    return result


@dataclass(frozen=True, slots=True)
class SettledStep:
    """A step's outcome, the same on every rank (``settled_step``)."""

    not_finite: bool  # some rank's loss was not finite
    loss: float  # the global batch's
    metrics: dict[str, float]  # by name, summed over the global batch's shares
    grad_norm: float  # the global gradient norm, before clipping


def settled_step(
    refused: str,
    finite: list[torch.Tensor],
    loss: torch.Tensor,
    metrics: Mapping[str, torch.Tensor | float],
    shares: int,
    device: str,
    grad_norm: torch.Tensor,
) -> SettledStep:
    """After the last backward: whether any rank's loss was not finite, the loss and the metrics
    summed over the ``shares`` of the global batch (every other rank holds a copy of one), and
    the global ``grad_norm`` read with them. First one fixed-size all-reduce of the verdicts --
    whether any rank refused a microbatch's loss (then every rank raises the first rank's
    refusal, before any metric is reduced) -- and of the metric names' fingerprint
    (``agreed_names``); then one all-reduce of the loss and each metric by name, sorted, 0 where
    a rank's loss gave no such metric. The host reads the device twice (once in a group of one,
    with no collective): the step's last reads, after which the optimizer step is queued."""
    names = sorted(metrics)
    not_finite = (~torch.stack(finite)).any().to(torch.float64).reshape(1)
    norm = grad_norm.detach().to(torch.float64).reshape(1)
    if dist.get_world_size() == 1:  # a group of one: its own verdicts and sums, one read
        if refused:
            agree(partial(raise_if, refused), device)
        out = torch.cat([not_finite, norm, stacked([loss, *(metrics[name] for name in names)], device)]).tolist()
        return SettledStep(
            not_finite=out[0] > 0, loss=out[2], metrics=dict(zip(names, out[3:], strict=True)), grad_norm=out[1]
        )
    header = torch.cat([not_finite, stacked([float(bool(refused)), *name_fingerprint(names)], device)])
    dist.all_reduce(header)
    out = torch.cat([header, norm]).tolist()  # the norm is every rank's already: read, not reduced
    if out[1]:
        agree(partial(raise_if, refused), device)
    names = agreed_names(names, out[2:-1])
    t = stacked([loss, *(metrics.get(name, 0.0) for name in names)], device)
    dist.all_reduce(t)
    copies = dist.get_world_size() // shares
    reduced = [v / copies for v in t.tolist()]
    return SettledStep(
        not_finite=out[0] > 0, loss=reduced[0], metrics=dict(zip(names, reduced[1:], strict=True)), grad_norm=out[-1]
    )


def stacked(values: Sequence[torch.Tensor | float], device: str) -> torch.Tensor:
    """``values`` (tensors, wherever they are, or host numbers) as one float64 vector on
    ``device``, with no wait for the device's queue (``from_host``)."""
    return torch.stack(
        [
            v.detach().to(device=device, dtype=torch.float64, non_blocking=True).reshape(())
            if isinstance(v, torch.Tensor)
            else from_host([float(v)], torch.float64, device).reshape(())
            for v in values
        ]
    )


def name_fingerprint(names: Sequence[str]) -> list[float]:
    """``[n, n^2, a, a^2, b, b^2]`` of a sorted list of metric names (``a``, ``b``: two 20-bit
    checksums of them): summed over the ranks, these say whether every rank has the same list
    (``agreed_names``). Exact in float64 for up to 2^12 ranks."""
    text = "\0".join(names).encode()
    parts = [len(names), zlib.crc32(text) & 0xFFFFF, zlib.adler32(text) & 0xFFFFF]
    return [float(v) for part in parts for v in (part, part * part)]


def agreed_names(names: list[str], summed: Sequence[float]) -> list[str]:
    """Collective: the metric names every rank reduces, in one order. When each rank's list is
    the same (the sums of ``name_fingerprint`` say so: ``sum(x)^2 == world * sum(x^2)`` holds
    only when every rank's ``x`` is equal), its own list; otherwise -- a metric a loss gives
    only on some ranks, ``if clipped.any(): m["clip_frac"] = ...`` -- the sorted union, gathered
    (a name a rank lacks counts 0 there). Never a reduction of tensors of different lengths, or
    of the same names in another order."""
    world = dist.get_world_size()
    pairs = [(round(summed[i]), round(summed[i + 1])) for i in range(0, len(summed), 2)]
    if all(total * total == world * squares for total, squares in pairs):
        return names
    every: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(every, names)
    return sorted({name for own in every for name in own})


def raise_if(problem: str) -> None:
    if problem:
        raise BatchError(problem)


def raise_non_finite(model: nn.Module, finite: list[torch.Tensor], loss: float, grad_norm: float, device: str) -> None:
    """A ``NonFiniteError`` on every rank (each calls it: the verdict was reduced), naming
    this rank's first microbatch whose loss is not finite and the first parameter (in model
    order, over all ranks) whose gradient is not."""
    bad = (~torch.stack(finite)).nonzero().flatten().tolist()
    parameter = first_non_finite(((n, p.grad) for n, p in model.named_parameters()), device)
    raise NonFiniteError(loss=loss, grad_norm=grad_norm, microbatch=bad[0] if bad else None, parameter=parameter)
