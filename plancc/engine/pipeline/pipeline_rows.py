"""A pipeline rank's rows for one step (``engine.pipeline.pipeline_steps``): unpadded, grouped by length (a
stage's shapes are fixed within a schedule step, not across steps), each length's rows cut into
microbatches of equal shape, and the fillers that keep the data-parallel ranks' steps in line."""

from __future__ import annotations

import torch

from ..batches import BatchError, default_token_mask, from_host, plan_microbatches


class RowGroup:
    """Rows of one length: their tokens [n, L], their index into the batch, every field cut to
    their span, and the microbatches they go through the pipeline in."""

    def __init__(
        self,
        batch: dict[str, torch.Tensor],
        rows: list[int],
        start: list[int],
        length: int,
        per: int,
        multiple: int = 1,
    ):
        """``multiple``: the rows go in padded on the right to a multiple of it (sequence
        parallelism shards the positions over tp ranks evenly); the padding is every field's 0,
        its attention mask's included, and comes after the row's last token (causal: no real
        position sees it)."""
        device = batch["input_ids"].device
        self.rows, self.start, self.length = rows, start, length
        self.microbatches = len(rows) // per
        padded = -(-length // multiple) * multiple
        idx = from_host(rows, torch.long, device)
        self._starts = from_host(start, torch.long, device)
        self._rows = idx
        width = batch["input_ids"].shape[1]
        offsets = torch.arange(padded, device=device)
        cols = (self._starts[:, None] + offsets).clamp(max=width - 1)
        real = (offsets < length)[None, :]
        self.fields: dict[str, torch.Tensor] = {}
        for name, value in batch.items():
            if value.dim() >= 2 and value.shape[1] == width:
                taken = value[idx[:, None], cols]
                keep = real.view(*real.shape, *[1] * (taken.dim() - 2))
                self.fields[name] = torch.where(keep, taken, torch.zeros_like(taken))
            else:
                self.fields[name] = value[idx]
        self.per, self.real = per, len(rows)  # rows beyond ``real`` are fillers (``pad_to``)
        self.input_ids = self.fields["input_ids"]
        self.index = torch.arange(len(rows), device=device)[:, None]  # the target: which rows a microbatch holds
        self.positions: torch.Tensor | None = None  # each row's own: 0, 1, ... (the stages count them)

    @classmethod
    def filler(cls, like: dict[str, torch.Tensor], microbatches: int, length: int = 2) -> RowGroup:
        """A step of ``microbatches`` one-row microbatches of ``length`` tokens that count nothing:
        a dp rank's turn in a schedule step it has no rows for."""
        ids = torch.zeros((microbatches, length), dtype=like["input_ids"].dtype, device=like["input_ids"].device)
        group = cls({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, [], [], length, 1)
        group.input_ids = ids
        group.fields = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        group.index = torch.arange(microbatches, device=ids.device)[:, None]
        group.microbatches = microbatches
        return group

    def pad_to(self, microbatches: int) -> None:
        """Grow to ``microbatches`` by fillers: copies of the first row, never counted."""
        extra = (microbatches - self.microbatches) * self.per
        if extra <= 0:
            return
        self.fields = {
            name: torch.cat([value, value[:1].expand(extra, *value.shape[1:])]) for name, value in self.fields.items()
        }
        self.input_ids = self.fields["input_ids"]
        self.index = torch.arange(self.input_ids.shape[0], device=self.input_ids.device)[:, None]
        self.microbatches = microbatches

    def places(self, local: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a microbatch of real rows (``local``: their index in the group) goes in the
        batch: its rows ``[n, 1]`` and their positions ``[n, length]`` (each row's own, not
        sequence parallelism's padding), on ``device``, from the indices made once for the step."""
        rows = self._rows.to(device)[local]
        cols = self._starts.to(device)[local][:, None] + torch.arange(self.length, device=device)
        return rows[:, None], cols

    def is_filler(self, index: torch.Tensor) -> bool:
        """Whether a microbatch (its rows' ``index``) is a filler: fillers are whole microbatches
        after the real rows."""
        return int(index.min()) >= self.real

    def loss_view(
        self, lp: torch.Tensor, local: torch.Tensor, per_position: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """What the caller's loss sees of a microbatch: its log-probs ``[rows, L]`` and every field
        of its rows (cut to their span), ``per_position`` values among them."""
        return lp, {**{name: value[local] for name, value in self.fields.items()}, **per_position}

    def place(self, out: torch.Tensor, value: torch.Tensor, local: torch.Tensor, *, predicted: bool = False) -> None:
        """A microbatch's per-position ``value`` ``[rows, L, ...]`` into its rows and positions of
        ``out`` ``[batch rows, S, ...]`` (the row's own positions, not sequence parallelism's
        padding; ``predicted``: log-probs, 0 at a row's first position already)."""
        rows, cols = self.places(local, value.device)
        out[rows, cols] = value[:, : self.length].to(out.dtype)


class PackedGroup:
    """Rows packed end to end into rows of one length (each row a document: positions from 0,
    attending to itself only), by ``batches.plan_microbatches``' token-budget rule: one schedule step for a rank's
    rows whatever their lengths, no pipeline fill and drain per length. The caller's loss still
    sees its rows as the batch holds them (``loss_view``), as ``Policy`` without stages packs."""

    def __init__(
        self,
        batch: dict[str, torch.Tensor],
        bins: list[list[tuple[int, int, int]]],
        capacity: int,
        per: int,
        multiple: int = 1,
    ) -> None:
        """``bins``: each packed row's (row, first position, tokens) spans;
        ``capacity``: a packed row's tokens; ``per``: packed rows a microbatch."""
        device = batch["input_ids"].device
        self.length = -(-capacity // multiple) * multiple
        count = len(bins)
        # every packed position's source (row, column), its own position and whether it is a
        # row's token, made on the host and copied once (``from_host``)
        src_row: list[int] = []
        src_col: list[int] = []
        positions: list[int] = []
        real: list[int] = []
        for members in bins:
            at = 0
            for row, first, n in members:
                src_row += [row] * n
                src_col += range(first, first + n)
                positions += range(n)
                real += [1] * n
                at += n
            left = self.length - at  # the padding: a document of its own, last
            src_row += [0] * left
            src_col += [0] * left
            positions += range(left)
            real += [0] * left
        shape = (count, self.length)
        self.batch = batch
        self.src_row = from_host(src_row, torch.long, device).view(shape)
        self.src_col = from_host(src_col, torch.long, device).view(shape)
        self.real_positions = from_host(real, torch.bool, device).view(shape)
        self.positions = from_host(positions, torch.long, device).view(shape)
        self.input_ids = torch.where(self.real_positions, batch["input_ids"][self.src_row, self.src_col], 0)
        self.rows_of = [[row for row, _, _ in members] for members in bins]  # each packed row's rows
        self.per, self.real, self.microbatches = per, count, count // per
        self.index = torch.arange(count, device=device)[:, None]
        self.fields = {"input_ids": self.input_ids}  # what a filler is shaped like (``PipelineRows.align``)

    def pad_to(self, microbatches: int) -> None:
        """Grow to ``microbatches`` by fillers: copies of the first packed row, never counted."""
        extra = (microbatches - self.microbatches) * self.per
        if extra <= 0:
            return

        def grown(value: torch.Tensor) -> torch.Tensor:
            return torch.cat([value, value[:1].expand(extra, *value.shape[1:])])

        self.input_ids, self.positions = grown(self.input_ids), grown(self.positions)
        self.fields = {"input_ids": self.input_ids}
        self.index = torch.arange(self.input_ids.shape[0], device=self.input_ids.device)[:, None]
        self.microbatches = microbatches

    def is_filler(self, index: torch.Tensor) -> bool:
        return int(index.min()) >= self.real

    def _rows(self, local: torch.Tensor) -> list[int]:
        return [row for b in local.tolist() for row in self.rows_of[b]]

    def loss_view(
        self, lp: torch.Tensor, local: torch.Tensor, per_position: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The microbatch's packed log-probs (0 at each document's first position: nothing in it
        predicts that token) unpacked into its rows ``[rows, S]`` at their batch positions, and
        every field of those rows as the batch holds them: the loss sees what it sees without
        stages. Differentiable (a scatter)."""
        rows = self._rows(local)
        device = lp.device
        slot = torch.full((self.batch["input_ids"].shape[0],), -1, dtype=torch.long, device=device)
        index = from_host(rows, torch.long, device)
        slot[index] = torch.arange(len(rows), device=device)
        width = self.batch["input_ids"].shape[1]
        real = self.real_positions[local]
        predicted = real & (self.positions[local] != 0)

        def unpacked(value: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            out = value.new_zeros((len(rows), width, *value.shape[2:]))
            return out.index_put((slot[self.src_row[local][keep]], self.src_col[local][keep]), value[keep])

        fields = {name: value[index.to(value.device)] for name, value in self.batch.items()}
        fields.update({name: unpacked(value, real) for name, value in per_position.items()})
        return unpacked(lp, predicted), fields

    def place(self, out: torch.Tensor, value: torch.Tensor, local: torch.Tensor, *, predicted: bool = False) -> None:
        """A microbatch's packed per-position ``value`` into its rows and positions of ``out``;
        ``predicted``: log-probs, not written at a document's first position."""
        keep = self.real_positions[local]
        if predicted:
            keep = keep & (self.positions[local] != 0)
        out[self.src_row[local][keep], self.src_col[local][keep]] = value[keep].to(out.dtype)


# one schedule step's rows: of one length, or packed
StepRows = RowGroup | PackedGroup


class PipelineRows:
    """This rank's rows unpadded, grouped by length (each group one schedule step)."""

    def __init__(
        self,
        groups: list[StepRows],
        tokens: float,
        sequences: float,
        multiple: int = 1,
        input_tokens: float = 0.0,
    ) -> None:
        self._groups, self.tokens, self.sequences, self.multiple = groups, tokens, sequences, multiple
        self.input_tokens = input_tokens  # every attended token (what throughput counts)

    def groups(self) -> list[StepRows]:
        return self._groups

    def align(self, steps: list[list[int]]) -> None:
        """As many schedule steps as the dp rank with the most, step ``j`` of as many
        microbatches as the most any dp rank runs in its step ``j`` (``steps``: every dp rank's
        microbatches per step)."""
        longest = max(len(s) for s in steps)
        wanted = [max(s[j] if j < len(s) else 0 for s in steps) for j in range(longest)]
        like = self._groups[0].fields
        for j, count in enumerate(wanted):
            if j < len(self._groups):
                self._groups[j].pad_to(count)
            else:
                self._groups.append(RowGroup.filler(like, count, max(2, self.multiple)))

    @classmethod
    def of(
        cls,
        batch: dict[str, torch.Tensor],
        *,
        micro_batch_size: int | None,
        max_tokens: int | None,
        microbatches: int,
        multiple: int = 1,
        pack: bool = False,
    ) -> PipelineRows:
        """Without --micro-batch-size or --max-tokens, each length's rows go in at least
        ``microbatches`` microbatches where they can (the plan's ``pipeline.microbatches``, or one
        per pipeline rank): a step of one microbatch would leave every stage but one idle.
        ``pack``: the rows packed end to end into rows of one length -- ``max_tokens`` tokens, or
        by default the rank's tokens over ``microbatches``; never less than the longest row -- one
        schedule step; ``micro_batch_size`` counts packed rows."""
        mask = batch["attention_mask"].bool()
        counted = batch.get("token_mask")
        token_mask = counted if counted is not None else default_token_mask(batch["attention_mask"])
        sample = batch.get("sample_mask")
        spans: dict[int, list[tuple[int, int]]] = {}
        lengths = mask.sum(1).tolist()
        firsts = mask.float().argmax(1).tolist()
        for row, (n, first) in enumerate(zip(lengths, firsts, strict=True)):
            if n == 0:
                raise BatchError(f"row {row} attends to no token")
            if not bool(mask[row, first : first + n].all()):
                raise BatchError(
                    f"row {row}'s attention_mask has a hole: under pipeline parallelism a row is one span "
                    "(left or right padding)"
                )
            spans.setdefault(n, []).append((row, first))
        sequences = float(sample.sum()) if sample is not None else float(mask.shape[0])
        tokens, attended = float(token_mask.sum()), float(sum(lengths))
        if pack:
            every = [(row, first, n) for n, members in spans.items() for row, first in members]
            # as many packed rows as the schedule wants microbatches, none shorter than the longest
            # row (a row is never cut), or rows of --max-tokens
            capacity = max(max(lengths), max_tokens or -(-sum(lengths) // microbatches))
            # the bins --max-tokens makes without stages (longest first, each to the least loaded
            # bin it fits): the same rule, here at one capacity for every bin
            lengths_of = [n for _, _, n in every]
            bins = [
                [every[i] for i in b] for b in plan_microbatches(lengths_of, micro_batch_size=None, max_tokens=capacity)
            ]
            per = rows_per_microbatch(len(bins), capacity, micro_batch_size, None, microbatches)
            packed = PackedGroup(batch, bins, capacity, per, multiple)
            return cls([packed], tokens, sequences, multiple, input_tokens=attended)
        groups: list[StepRows] = []
        for length in sorted(spans):
            members = spans[length]
            per = rows_per_microbatch(len(members), length, micro_batch_size, max_tokens, microbatches)
            groups.append(RowGroup(batch, [r for r, _ in members], [s for _, s in members], length, per, multiple))
        return cls(groups, tokens, sequences, multiple, input_tokens=attended)


def fingerprint(ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """Rows' identity in three numbers (the same rows give the same; wrapping is fine)."""
    weights = torch.arange(1, ids.numel() + 1, device=ids.device).reshape(ids.shape)
    sums = torch.stack([(ids.long() * weights).sum(), (mask.long() * weights).sum()]) % 2**52
    first, second = sums.tolist()
    return int(first), int(second), tuple(ids.shape)


def rows_per_microbatch(
    rows: int, length: int, micro_batch_size: int | None, max_tokens: int | None, microbatches: int = 1
) -> int:
    """The most rows a microbatch of this length takes within --micro-batch-size and
    --max-tokens (or, with neither, in at least ``microbatches`` microbatches) that divides the
    group (the schedule cuts a step's rows evenly); 1 at least."""
    cap = rows if micro_batch_size or max_tokens else max(1, rows // microbatches)
    if micro_batch_size:
        cap = min(cap, micro_batch_size)
    if max_tokens:
        cap = min(cap, max(1, max_tokens // length))
    return next(d for d in range(cap, 0, -1) if rows % d == 0)
