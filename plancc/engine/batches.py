"""One place that cuts a rank's slice of a global batch into microbatches, for ``train`` and
``logprobs`` alike: by rows (``micro_batch_size``), by a token budget (``max_tokens``), and with
the rows of a microbatch packed into one row without padding (``pack``).

A batch is a dict of tensors whose first dim is the row: ``input_ids [b, s]``,
``attention_mask [b, s]`` and whatever else the loss reads (``advantages [b]``,
``old_logprobs [b, s]``, ...). ``check_batch`` says what is wrong with one before anything runs
(every problem names the field, row or microbatch), ``plan_microbatches`` chooses the rows of
each microbatch, ``Microbatch`` lays one out for the model (padded to the sequence multiple the
layout needs, or packed with ``cu_seqlens``) and puts the model's per-position results back
into the batch's own ``[rows, s]`` shape.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .values import given_or_keywords

Batch = Mapping[str, torch.Tensor]


class BatchError(ValueError):
    """A batch, or a way of cutting it, that cannot be trained or evaluated as given."""


def check_batch(
    batch: Batch, *, max_tokens: int | None = None, micro_batch_size: int | None = None, vocab_size: int | None = None
) -> None:
    """Raise ``BatchError`` naming the field or row when ``batch`` cannot be used."""
    if not isinstance(batch, Mapping):
        raise BatchError(f"a batch is a dict of tensors, got {type(batch).__name__}")
    for name in ("input_ids", "attention_mask"):
        if name not in batch:
            raise BatchError(f"the batch has no '{name}' field (fields: {sorted(batch)})")
    for name, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise BatchError(f"field '{name}' is a {type(value).__name__}, not a tensor")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] < 2:
        raise BatchError(f"'input_ids' must be [rows, seq] with rows >= 1 and seq >= 2, got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise BatchError(f"'input_ids' must hold integer token ids, got {ids.dtype}")
    rows, seq = ids.shape
    if vocab_size is not None:  # the embedding reads every position, padding too
        outside = (ids < 0) | (ids >= vocab_size)
        if bool(outside.any()):
            row, position = (int(i) for i in outside.nonzero()[0])
            raise BatchError(
                f"row {row} position {position} holds token id {int(ids[row, position])}, outside the "
                f"vocabulary [0, {vocab_size}) (padding positions are embedded too: pad with a real id such as 0)"
            )
    for name, value in batch.items():
        if value.ndim == 0 or value.shape[0] != rows:
            got = tuple(value.shape)
            raise BatchError(f"field '{name}' has shape {got}: its rows disagree with input_ids' {rows}")
        if value.ndim >= 2 and value.shape[1] != seq:  # a 2-D field is per token: sliced along them too
            raise BatchError(f"field '{name}' has {value.shape[1]} positions per row, input_ids {seq}")
    if mask.shape != ids.shape:
        raise BatchError(f"'attention_mask' {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    empty = (mask.sum(1) == 0).nonzero().flatten().tolist()
    if empty:
        raise BatchError(f"row {empty[0]} has no attended token (attention_mask all 0)")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise BatchError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens is not None:
        lengths = mask.sum(1)
        longest = int(lengths.argmax())
        if max_tokens < 1 or int(lengths[longest]) > max_tokens:
            raise BatchError(
                f"row {longest} has {int(lengths[longest])} tokens, more than max_tokens={max_tokens}: "
                "raise max_tokens to at least the longest row"
            )


def plan_microbatches(lengths: list[int], *, micro_batch_size: int | None, max_tokens: int | None) -> list[list[int]]:
    """The rows of each microbatch, from the rows' token counts: consecutive groups of
    ``micro_batch_size`` rows; bins of at most ``max_tokens`` tokens (first fit, longest rows
    first, so the bins come out balanced); else one microbatch of every row."""
    rows = list(range(len(lengths)))
    if max_tokens is not None:
        bins: list[list[int]] = []
        loads: list[int] = []
        for r in sorted(rows, key=lambda r: -lengths[r]):
            fits = [b for b in range(len(bins)) if loads[b] + lengths[r] <= max_tokens]
            if fits:
                b = min(fits, key=lambda b: loads[b])  # the least loaded bin that fits: balanced
                bins[b].append(r)
                loads[b] += lengths[r]
            else:
                bins.append([r])
                loads.append(lengths[r])
        return [sorted(b) for b in bins]
    size = micro_batch_size or len(rows)
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """The rows of a global batch in ``parts`` groups of equal row counts whose token sums are
    as even as longest-first greedy makes them: each row, longest first, to the group with the
    fewest tokens that still has room (ties to the lowest group: every rank computes the same
    partition from the same lengths). Where that is no more even than contiguous slices
    (uniform lengths), the contiguous slices (``Policy.slice_of``'s). Every group is sorted.

    Why: a step waits for its slowest dp rank, and with long-tailed RL response lengths equal
    row counts can hold several times as many tokens on one rank as on another (verl balances
    the same way before its update). The loss is normalized over the global batch (``BatchTotals``),
    so which rank holds which rows does not change the step."""
    rows, per = len(lengths), len(lengths) // parts
    assert per * parts == rows, "a global batch splits into equal row counts (checked by the caller)"
    contiguous = [list(range(p * per, (p + 1) * per)) for p in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for r in sorted(range(rows), key=lambda r: -lengths[r]):
        room = [g for g in range(parts) if len(groups[g]) < per]
        g = min(room, key=lambda g: (loads[g], g))
        groups[g].append(r)
        loads[g] += lengths[r]
    most = max(sum(lengths[r] for r in group) for group in contiguous)
    return contiguous if max(loads) >= most else [sorted(group) for group in groups]


def split_to_count(microbatches: list[list[int]], count: int) -> list[list[int]]:
    """``microbatches`` made ``count`` long (collectives line up only when every dp rank runs
    as many forwards and backwards): the largest ones split in two while that is possible; what
    is still missing is an empty microbatch (a dummy pass that adds nothing)."""
    out = [list(m) for m in microbatches]
    while len(out) < count:
        largest = max(range(len(out)), key=lambda i: len(out[i]))
        if len(out[largest]) < 2:
            break
        rows = out.pop(largest)
        out[largest:largest] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return out + [[] for _ in range(count - len(out))]


@dataclass(frozen=True, slots=True)
class RowSpan:
    """Where a row's attended tokens are: from ``start`` to ``end`` (exclusive), ``count`` of them
    (``end - start`` unless the mask has holes)."""

    start: int
    end: int
    count: int

    @property
    def contiguous(self) -> bool:
        return self.end - self.start == self.count


def row_spans(mask: torch.Tensor) -> list[RowSpan]:
    """Every row's ``RowSpan``, in one host read for all the rows (a step reads them once and
    cuts and packs every microbatch from them: no device read per microbatch or row)."""
    real = mask.bool()
    seq = mask.shape[1]
    positions = torch.arange(1, seq + 1, device=mask.device)
    end = (real * positions).amax(1)
    start = torch.where(real, positions, torch.full_like(positions, seq + 1)).amin(1) - 1
    return [RowSpan(*row) for row in torch.stack([start, end, real.sum(1)], 1).tolist()]


def from_host(values: list[int] | list[float], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` on ``device`` without the host waiting for the device's queue: made on the host,
    then copied asynchronously (``torch.tensor(values, device="cuda")`` copies from pageable
    memory synchronously: the host would wait there for every kernel queued before, the last
    step's optimizer included, and the device then idles while the host catches up)."""
    return torch.tensor(values, dtype=dtype, device="cpu").to(device, non_blocking=True)


def default_token_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions that have a log-prob: attended, after the first, and after an attended one
    (the log-prob of the first real token after left padding comes from padding alone)."""
    real = attention_mask.bool()
    keep = real.clone()
    keep[:, 0] = False
    keep[:, 1:] &= real[:, :-1]
    return keep


@dataclass(frozen=True, kw_only=True, slots=True)
class Microbatching:
    """How ``Policy.train``, ``logprobs`` and ``reference_logprobs`` cut a rank's rows into
    microbatches: ``micro_batch_size`` rows, or rows up to ``max_tokens`` real tokens (a token
    budget), each cut's rows concatenated into one row of documents with ``pack`` (default: one
    microbatch of every row). The same as the keywords of the same names."""

    micro_batch_size: int | None = None
    max_tokens: int | None = None
    pack: bool = False

    @classmethod
    def of(cls, given: Microbatching | None, keywords: Mapping[str, Any]) -> Microbatching:
        """``given``, or the value its fields as keywords spell (``engine.values``)."""
        return given_or_keywords(cls, given, keywords, "microbatching")


@dataclass(frozen=True, kw_only=True, slots=True)
class Microbatch:
    """Some rows of a batch laid out for one forward: ``input_ids``, ``attention_mask`` (None when
    packed or when no row has padding) and ``cu_seqlens`` (packed only) as the model takes them,
    and how to put the model's per-position results back into ``[rows, s]``."""

    rows: list[int]
    fields: dict[str, torch.Tensor]  # every field of the batch, these rows (what the loss reads)
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    positions: list[torch.Tensor] | None  # packed: each row's attended positions
    seq: int  # the batch's own sequence length
    starts: list[int] | None = None  # packed: where each row's document starts (cu_seqlens on the host)

    @classmethod
    def of(
        cls, batch: Batch, rows: list[int], *, multiple: int, pack: bool, spans: list[RowSpan] | None = None
    ) -> Microbatch:
        """``rows`` of ``batch``, cut to their own last attended position (what follows it is
        padding in every row: causal attention never lets it reach an earlier position, so
        computing it only costs) and padded on the right to a multiple of ``multiple`` positions
        (SP: tp; CP: 2 * cp); or packed: each row's attended tokens one after the other, each
        document padded to the multiple (CP shards every document). ``spans``: every row of the
        batch's ``RowSpan``, when the caller read them already (a device read per microbatch
        otherwise)."""
        index = from_host(rows, torch.long, batch["input_ids"].device)
        fields = {name: value.index_select(0, index) for name, value in batch.items()}
        ids, mask = fields["input_ids"], fields["attention_mask"]
        seq = ids.shape[1]
        mine = [spans[r] for r in rows] if spans is not None else row_spans(mask)
        if not pack:
            end = max(2, max(span.end for span in mine))
            width = -(-end // multiple) * multiple
            ids = _to_width(ids, width)
            # rows without padding need no mask: the model's mask builder then does not ask the
            # device whether there is any (transformers reads ``padding_mask.all()`` on the host)
            full = all(span.start == 0 and span.end == width and span.contiguous for span in mine)
            return cls(
                rows=rows,
                fields=fields,
                input_ids=ids,
                attention_mask=None if full else _to_width(mask, width),
                cu_seqlens=None,
                positions=None,
                seq=seq,
            )
        # a contiguous row's positions are known on the host; a row with holes asks the device
        positions = [
            torch.arange(span.start, span.end, device=ids.device) if span.contiguous else m.nonzero().flatten()
            for span, m in zip(mine, mask.bool(), strict=True)
        ]
        lengths = [-(-span.count // multiple) * multiple for span in mine]
        starts = [0, *itertools.accumulate(lengths)]
        packed = torch.zeros((1, starts[-1]), dtype=ids.dtype, device=ids.device)
        for r, where in enumerate(positions):
            packed[0, starts[r] : starts[r] + len(where)] = ids[r, where]
        return cls(
            rows=rows,
            fields=fields,
            input_ids=packed,
            attention_mask=None,
            cu_seqlens=from_host(starts, torch.int32, ids.device),
            positions=positions,
            seq=seq,
            starts=starts,
        )

    def unpack(self, per_position: torch.Tensor) -> torch.Tensor:
        """The model's ``[rows', s']`` result (padded or packed) as ``[rows, s]`` of the batch:
        0 where the batch has padding."""
        if self.positions is None:  # cut to the rows' own length: padded back to the batch's
            return _to_width(per_position, self.seq)
        assert self.starts is not None, "a packed microbatch has its boundaries"
        out = per_position.new_zeros((len(self.rows), self.seq))
        for start, (r, where) in zip(self.starts, enumerate(self.positions), strict=False):
            out[r, where] = per_position[0, start : start + len(where)]
        return out

    def batch_positions(self) -> torch.Tensor:
        """``[rows', s']`` as the model takes the rows: each model position's flat index into
        the microbatch's own ``[rows, s]`` fields (``row * s + position``), -1 where the layout
        added it (the padding to the sequence multiple)."""
        device = self.input_ids.device
        if self.positions is None:
            rows, width = self.input_ids.shape
            t = torch.arange(width, device=device)
            index = torch.arange(rows, device=device)[:, None] * self.seq + t[None, :]
            return torch.where(t[None, :] < self.seq, index, torch.full_like(index, -1))
        assert self.starts is not None, "a packed microbatch has its boundaries"
        out = torch.full(self.input_ids.shape, -1, dtype=torch.long, device=device)
        for r, (start, where) in enumerate(zip(self.starts, self.positions, strict=False)):
            out[0, start : start + len(where)] = r * self.seq + where
        return out

    def per_token(self, evaluated: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every field at the tokens ``evaluated`` names (flat indices as ``batch_positions``
        gives them, -1 for none), in that order: a per-token field ``[rows, s, ...]`` at its
        position, a per-row field ``[rows, ...]`` at its row; 0 where ``evaluated`` is -1."""
        known = evaluated >= 0
        flat = evaluated.clamp(min=0)
        out = {}
        for name, value in self.fields.items():
            per_row = value.ndim == 1  # check_batch: a 2-D field has the batch's positions
            picked = value[flat // self.seq] if per_row else value.reshape(-1, *value.shape[2:])[flat]
            keep = known.view(-1, *[1] * (picked.dim() - 1))
            out[name] = torch.where(keep, picked, torch.zeros_like(picked))
        return out


def _to_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t [rows, s, ...]`` cut or zero-padded on the right to ``width`` positions."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]))


def dp_slice(global_rows: int, dp_rank: int, dp_size: int) -> slice:
    """Data-parallel rank ``dp_rank``'s rows of a global batch of ``global_rows`` (which dp must
    divide): ``Policy.slice_of``."""
    if global_rows % dp_size:
        raise BatchError(f"a global batch of {global_rows} rows does not split over dp={dp_size}")
    per = global_rows // dp_size
    return slice(dp_rank * per, (dp_rank + 1) * per)


def balanced_dp_rows(lengths: list[int] | torch.Tensor, dp_rank: int, dp_size: int) -> list[int]:
    """``Policy.balanced_slices``: rank ``dp_rank``'s rows of a global batch whose rows hold
    ``lengths`` tokens, as many as ``dp_slice`` gives, the token counts as even as possible."""
    counts = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    dp_slice(len(counts), dp_rank, dp_size)  # the same refusal when dp does not divide the rows
    return balanced_partition([int(c) for c in counts], dp_size)[dp_rank]
