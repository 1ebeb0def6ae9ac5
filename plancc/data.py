"""Token batches for `plancc apply` / `plancc logprobs`.

Synthetic batches are a pure function of (seed, step), and a JSONL file is read whole and
validated before any step runs, so every layout (and a resumed run) sees the same global
batch at the same step: that is what lets a resumed loss curve continue exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import Diagnostic, PlanError, SourceLoc


class DataError(PlanError):
    """Bad training data: reported as FILE:LINE diagnostics before any step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenDataset:
    """Pre-tokenized sequences, each a list of ids, with where each came from."""

    sequences: tuple[tuple[int, ...], ...]
    path: str = "<synthetic>"


def read_jsonl(path: str | Path, *, vocab_size: int) -> TokenDataset:
    """Read ``{"input_ids": [...]}`` per line; report every bad line, then raise."""
    shown = str(path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError([Diagnostic(rule="data-file", loc=SourceLoc(path=shown), message="no such data file",
                                    fix="pass a JSONL file with one {\"input_ids\": [...]} per line")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError([Diagnostic(rule="data-file", loc=SourceLoc(path=shown),
                                    message=f"cannot read the data file: {exc}", fix="pass a UTF-8 JSONL file")]) from None
    problems: list[Diagnostic] = []
    sequences: list[tuple[int, ...]] = []

    def bad(line_no: int, rule: str, message: str, fix: str) -> None:
        problems.append(Diagnostic(rule=rule, loc=SourceLoc(path=shown, line=line_no, column=1),
                                   message=message, fix=fix))

    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            bad(line_no, "data-json", f"not valid JSON: {exc.msg} (column {exc.colno})",
                "write one JSON object per line")
            continue
        if not isinstance(record, dict) or "input_ids" not in record:
            bad(line_no, "data-input-ids", "the line has no 'input_ids'",
                'write {"input_ids": [1, 2, 3]}')
            continue
        ids = record["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in ids):
            bad(line_no, "data-input-ids", "'input_ids' must be a non-empty list of integers",
                'write {"input_ids": [1, 2, 3]}')
            continue
        out_of_range = [t for t in ids if t < 0 or t >= vocab_size]
        if out_of_range:
            bad(line_no, "data-token-range",
                f"token id {out_of_range[0]} is outside the vocabulary [0, {vocab_size})",
                "tokenize with the model's own tokenizer")
            continue
        sequences.append(tuple(ids))
    if not problems and not sequences:
        problems.append(Diagnostic(rule="data-empty", loc=SourceLoc(path=shown), message="the data file has no sequences",
                                   fix="add at least one {\"input_ids\": [...]} line"))
    if problems:
        raise DataError(problems)
    return TokenDataset(sequences=tuple(sequences), path=shown)


def synthetic_batch(step: int, *, seed: int, batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Learnable synthetic tokens: each row counts from a random start with a random small
    stride (mod vocab), so a working training loop visibly lowers the loss."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % vocab_size


def dataset_batch(data: TokenDataset, step: int, *, batch_size: int, seq_len: int, pad_id: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``step*batch_size ...`` (cycling), each cut or right-padded to ``seq_len``.
    Returns (input_ids, attention_mask)."""
    ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((batch_size, seq_len), dtype=torch.long)
    n = len(data.sequences)
    for row in range(batch_size):
        seq = data.sequences[(step * batch_size + row) % n][:seq_len]
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask
