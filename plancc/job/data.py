"""Token batches for `plancc apply` / `plancc logprobs`.

Synthetic batches are a pure function of (seed, step), and a JSONL file is read whole and
validated before any step runs, so every layout (and a resumed run) sees the same global
batch at the same step: that is what lets a resumed loss curve continue exactly.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import Diagnostic, PlanError, SourceLoc
from ..inputs import InputKind, read_lines


class DataError(PlanError):
    """Bad training data: reported as FILE:LINE diagnostics before any step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenDataset:
    """Pre-tokenized sequences, each a list of ids, with where each came from."""

    sequences: tuple[tuple[int, ...], ...]
    path: str = "<synthetic>"


_EXAMPLE = 'write {"input_ids": [1, 2, 3]}'
_UTF8 = 'pass a UTF-8 JSONL file with one {"input_ids": [...]} per line'
DATA_INPUT = InputKind(what="data", fix=_UTF8)
MAX_REPORTED = 20  # bad lines reported before the read stops
# The longest line read: 8M token ids of up to 7 digits. A longer "line" is another kind of file.
MAX_LINE_BYTES = 64 << 20


class _BadLine(Exception):
    """Why one line of a data file is not a sequence (rule, message, fix)."""

    def __init__(self, rule: str, message: str, fix: str = _EXAMPLE):
        super().__init__(message)
        self.rule, self.message, self.fix = rule, message, fix


def _parse_line(line: str, vocab_size: int, min_tokens: int, max_tokens: int | None) -> tuple[int, ...]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _BadLine(
            "data-json", f"not valid JSON: {exc.msg} (column {exc.colno})", "write one JSON object per line"
        ) from None
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits; nesting past the stack
        why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise _BadLine("data-json", f"not readable as JSON: {why}") from None
    if not isinstance(record, dict) or "input_ids" not in record:
        raise _BadLine("data-input-ids", "the line has no 'input_ids'")
    ids = record["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _BadLine("data-input-ids", "'input_ids' must be a non-empty list of integers")
    if len(ids) < min_tokens:  # a lone token predicts nothing: training on it would report a loss of 0
        raise _BadLine(
            "data-too-short",
            f"the line has {len(ids)} token; training needs at least {min_tokens} "
            "(one to predict from, one to predict)",
            "drop lines of one token or join them to others",
        )
    if max_tokens is not None and len(ids) > max_tokens:  # a batch pads every line to its longest one
        raise _BadLine(
            "data-too-long",
            f"the line has {len(ids)} tokens; the model takes at most {max_tokens} (max_position_embeddings)",
            "split or truncate the line",
        )
    out_of_range = [t for t in ids if t < 0 or t >= vocab_size]
    if out_of_range:
        raise _BadLine(
            "data-token-range",
            f"token id {out_of_range[0]} is outside the vocabulary [0, {vocab_size})",
            "tokenize with the model's own tokenizer",
        )
    return tuple(ids)


def read_jsonl(
    path: str | Path,
    *,
    vocab_size: int,
    min_tokens: int = 1,
    max_tokens: int | None = None,
    wait_s: float | None = None,
) -> TokenDataset:
    """Read ``{"input_ids": [...]}`` per line; report every bad line (the first
    ``MAX_REPORTED`` of them: the read stops there), then raise. Training reads with
    ``min_tokens=2``: a sequence of one token has nothing to predict. ``path`` may be a pipe
    (``--data <(...)``, ``/dev/stdin``): it is read once, as it arrives (``plancc.inputs``)."""
    shown = str(path)
    problems: list[Diagnostic] = []
    sequences: list[tuple[int, ...]] = []
    try:
        _parse_lines(
            read_lines(path, DATA_INPUT, max_line=MAX_LINE_BYTES, wait_s=wait_s),
            shown,
            problems,
            sequences,
            vocab_size=vocab_size,
            min_tokens=min_tokens,
            max_tokens=max_tokens,
        )
    except PlanError as exc:  # the path itself: missing, a folder, a silent pipe, an endless device
        # a data problem (exit 1), as every other problem of the data file
        raise DataError([*problems, *(replace(d, rule="data-file") for d in exc.diagnostics)]) from None
    if not problems and not sequences:
        problems.append(
            Diagnostic(
                rule="data-empty",
                loc=SourceLoc(path=shown),
                message="the data file has no sequences",
                fix='add at least one {"input_ids": [...]} line',
            )
        )
    if problems:
        raise DataError(problems)
    return TokenDataset(sequences=tuple(sequences), path=shown)


def _parse_lines(
    lines: Iterator[bytes],
    shown: str,
    problems: list[Diagnostic],
    sequences: list[tuple[int, ...]],
    *,
    vocab_size: int,
    min_tokens: int,
    max_tokens: int | None,
) -> None:
    for line_no, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            sequences.append(_parse_line(line, vocab_size, min_tokens, max_tokens))
        except UnicodeDecodeError as exc:
            problems.append(_bad(shown, line_no, "data-json", f"byte {exc.start + 1} is not valid UTF-8", _UTF8))
        except _BadLine as bad:
            problems.append(_bad(shown, line_no, bad.rule, bad.message, bad.fix))
        if len(problems) >= MAX_REPORTED:  # a binary file or a device: stop reading, not one line per byte
            problems.append(
                Diagnostic(
                    rule="data-file",
                    loc=SourceLoc(path=shown),
                    message=f"{MAX_REPORTED} bad lines: the rest of the file was not read",
                    fix=_UTF8,
                )
            )
            break


def _bad(shown: str, line_no: int, rule: str, message: str, fix: str) -> Diagnostic:
    return Diagnostic(rule=rule, loc=SourceLoc(path=shown, line=line_no, column=1), message=message, fix=fix)


def write_tokens(data: TokenDataset, path: str | Path) -> None:
    """The checked dataset in a compact form for the workers: the launcher read (and checked)
    ``--data`` once; its workers load this copy instead of reading the user's path again (a
    pipe can be read once only, a file can change in between)."""
    lengths = array("q", map(len, data.sequences))
    tokens = array("q", (t for seq in data.sequences for t in seq))
    with open(path, "wb") as f:
        f.write(json.dumps({"path": data.path, "count": len(lengths)}).encode() + b"\n")
        lengths.tofile(f)
        tokens.tofile(f)


def read_tokens(path: str | Path) -> TokenDataset:
    """What ``write_tokens`` wrote."""
    with open(path, "rb") as f:
        head = json.loads(f.readline())
        lengths = array("q")
        lengths.fromfile(f, head["count"])
        tokens = array("q")
        tokens.frombytes(f.read())
    sequences, at = [], 0
    for n in lengths:
        sequences.append(tuple(tokens[at : at + n]))
        at += n
    return TokenDataset(sequences=tuple(sequences), path=head["path"])


def synthetic_batch(step: int, *, seed: int, batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Learnable synthetic tokens: each row counts from a random start with a random small
    stride (mod vocab), so a working training loop visibly lowers the loss."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % vocab_size


def dataset_batch(
    data: TokenDataset, step: int, *, batch_size: int, seq_len: int, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``step*batch_size ...`` (cycling), each cut or right-padded to ``seq_len``.
    Returns (input_ids, attention_mask)."""
    n = len(data.sequences)
    rows = [data.sequences[(step * batch_size + row) % n][:seq_len] for row in range(batch_size)]
    return padded_rows(rows, width=seq_len, pad_id=pad_id)


def padded_rows(
    sequences: list[tuple[int, ...]], *, width: int | None = None, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of token sequences (none longer than ``width``),
    right-padded with ``pad_id`` to ``width``, or to the longest (at least 2 positions: a batch
    row holds a token and what follows it); the engine pads further to the layout's sequence
    multiple or packs them (``engine.batches.Microbatch``)."""
    width = width if width is not None else max(2, *(len(s) for s in sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask
