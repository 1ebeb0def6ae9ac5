"""A pipeline rank's rows for one step (``engine.pipelined``): unpadded, grouped by length (a
stage's shapes are fixed within a schedule step, not across steps), each length's rows cut into
microbatches of equal shape, and the fillers that keep the data-parallel ranks' steps in line."""

from __future__ import annotations

import torch

from .batches import BatchError, default_token_mask, from_host


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


class PipelineRows:
    """This rank's rows unpadded, grouped by length (each group one schedule step)."""

    def __init__(
        self, groups: list[RowGroup], tokens: float, sequences: float, multiple: int = 1, input_tokens: float = 0.0
    ) -> None:
        self._groups, self.tokens, self.sequences, self.multiple = groups, tokens, sequences, multiple
        self.input_tokens = input_tokens  # every attended token (what throughput counts)

    def groups(self) -> list[RowGroup]:
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
    ) -> PipelineRows:
        """Without --micro-batch-size or --max-tokens, each length's rows go in at least
        ``microbatches`` microbatches where they can (the plan's ``pipeline.microbatches``, or one
        per pipeline rank): a step of one microbatch would leave every stage but one idle."""
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
        groups = []
        for length in sorted(spans):
            members = spans[length]
            per = rows_per_microbatch(len(members), length, micro_batch_size, max_tokens, microbatches)
            groups.append(RowGroup(batch, [r for r, _ in members], [s for _, s in members], length, per, multiple))
        sequences = float(sample.sum()) if sample is not None else float(mask.shape[0])
        return cls(groups, float(token_mask.sum()), sequences, multiple, input_tokens=float(sum(lengths)))


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
