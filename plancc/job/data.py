"""Token batches for `plancc apply` / `plancc logprobs`.

Synthetic batches are a pure function of (seed, step), and ``--data`` is read through once and
validated before any step runs (its rows kept in a file, ``job.token_rows``), so every layout
(and a resumed run) sees the same global batch at the same step: that is what lets a resumed
loss curve continue exactly.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import Diagnostic, PlanError, Severity, SourceLoc
from ..inputs import InputKind, read_lines
from .data_order import RowOrder
from .hf_datasets import DatasetProblem, dataset_rows, is_dataset
from .records import KNOWN_FIELDS, BadRecord, DataFields, Tokenizer, parse_record, record_format, rows_of
from .token_rows import RowsWriter, TokenRows


class DataError(PlanError):
    """Bad training data: reported as FILE:LINE diagnostics before any step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenDataset:
    """Pre-tokenized sequences, each a list of ids, with where each came from.

    ``masks``: per sequence, which tokens the loss counts (1) -- from a line's ``labels``
    (-100: not counted, transformers' convention) or ``loss_mask`` -- or None where every token
    counts; None for the whole dataset when no line has one. ``unused``: fields the lines hold
    that the run does not read (said once, in a warning)."""

    sequences: TokenRows  # in a file, mapped, read row by row
    path: str = "<synthetic>"
    masks: TokenRows | None = None
    unused: tuple[str, ...] = ()
    # what the lines were read as (records.record_format), each with the fields it reads
    formats: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # how many documents (lines, dataset rows) the rows came from: more rows than documents
    # where ``--seq-len`` cut long ones into rows (``records.rows_of``); None: one row each
    documents: int | None = None

    def lengths(self) -> list[int]:
        """Every row's length (from the rows' offsets: no row is read)."""
        return list(self.sequences.lengths())

    @property
    def longest(self) -> int:
        return max(self.lengths(), default=0)


SYNTHETIC = "synthetic"  # the digest of a run on the synthetic rows of a preset (no --data)


def data_identity(data: TokenDataset | None) -> dict[str, Any]:
    """What a checkpoint keeps of the rows its run trained on -- their count, their tokens and a
    digest of every token id and loss mask -- so that a resume on other rows says so (the steps
    after the checkpoint are then not the uninterrupted run's)."""
    if data is None:
        return {"data_digest": SYNTHETIC}
    digest = hashlib.blake2b(digest_size=16)
    for rows in (data.sequences, data.masks):
        digest.update(b"rows" if rows is not None else b"none")
        if rows is not None:
            rows.fold_into(digest)
    return {"data_rows": len(data.sequences), "data_tokens": sum(data.lengths()), "data_digest": digest.hexdigest()}


_UTF8 = 'pass a UTF-8 JSONL file with one {"input_ids": [...]} per line'
DATA_INPUT = InputKind(what="data", fix=_UTF8)
MAX_REPORTED = 20  # bad lines reported before the read stops
# The longest line read: 8M token ids of up to 7 digits. A longer "line" is another kind of file.
MAX_LINE_BYTES = 64 << 20


def _decoded(line: str) -> Any:
    """A JSONL line's record (its problems as a ``BadRecord``)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadRecord(
            "data-json", f"not valid JSON: {exc.msg} (column {exc.colno})", "write one JSON object per line"
        ) from None
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits; nesting past the stack
        why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise BadRecord("data-json", f"not readable as JSON: {why}") from None


def read_jsonl(
    path: str | Path,
    *,
    vocab_size: int,
    min_tokens: int = 1,
    max_tokens: int | None = None,
    wait_s: float | None = None,
    fields: DataFields | None = None,
    tokenizer: Tokenizer | None = None,
    row_length: int | None = None,
    split: str | None = None,
) -> TokenDataset:
    """Read one record per line (``job.records``: ``{"input_ids": [...]}``, or text for the
    model folder's ``tokenizer``) -- or per row, where ``path`` is what Hugging Face ``datasets``
    reads (parquet, arrow, JSON, a folder of them, a saved dataset: ``job.hf_datasets``); report
    every bad one (the first ``MAX_REPORTED`` of them: the read stops there), then raise.
    Training reads with ``min_tokens=2``: a sequence of one token has nothing to predict, and
    with ``row_length`` (its ``--seq-len``): a longer document becomes rows of that many tokens,
    every token kept (``records.rows_of``), a longer conversation is refused.
    ``path`` may be a pipe (``--data <(...)``, ``/dev/stdin``): it is read once, as it arrives
    (``plancc.inputs``). ``split``: that split of a dataset folder (``--eval-split``)."""
    shown = str(path)
    problems: list[Diagnostic] = []
    # the rows go to files as they are read (token_rows): only their offsets stay in memory
    sequences, masks = RowsWriter("q"), RowsWriter("b")
    unused: dict[str, None] = {}
    formats: dict[tuple[str, tuple[str, ...]], None] = {}
    documents = [0]
    dataset = is_dataset(path) or split is not None
    if split is not None:
        shown = f"{shown} ({split} split)"
    try:
        _parse_lines(
            dataset_rows(path, split)
            if dataset
            else read_lines(path, DATA_INPUT, max_line=MAX_LINE_BYTES, wait_s=wait_s),
            shown,
            problems,
            (sequences, masks, unused, formats),
            vocab_size=vocab_size,
            min_tokens=min_tokens,
            max_tokens=max_tokens,
            fields=fields,
            tokenizer=tokenizer,
            records=dataset,
            row_length=row_length,
            documents=documents,
        )
    except DatasetProblem as exc:  # the dataset as a whole
        problems.append(exc.diagnostic(shown))
    except PlanError as exc:  # the path itself: missing, a folder, a silent pipe, an endless device
        # a data problem (exit 1), as every other problem of the data file
        sequences.discard()
        masks.discard()
        raise DataError([*problems, *(replace(d, rule="data-file") for d in exc.diagnostics)]) from None
    rows, masked = sequences.finish(), masks.finish(keep_absent=True)
    if not problems and not len(rows):
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
    return TokenDataset(
        sequences=rows,
        path=shown,
        masks=masked if any(masked.present or ()) else None,
        unused=tuple(unused),
        formats=tuple(formats),
        documents=documents[0] if documents[0] != len(rows) else None,
    )


def unused_fields_warning(data: TokenDataset) -> Diagnostic | None:
    """The fields of the data the run does not read, named once with what it does read (a
    ``text`` or ``mask`` field a user expected to matter trains without a word otherwise)."""
    if not data.unused:
        return None
    names = ", ".join(repr(name) for name in data.unused)
    read = "; ".join(f"{kind}: {', '.join(fields)}" for kind, fields in data.formats) or ", ".join(KNOWN_FIELDS[:3])
    tokens = any(kind == "token ids" for kind, _ in data.formats) or not data.formats
    return Diagnostic(
        rule="data-unused-field",
        loc=SourceLoc(path=data.path),
        severity=Severity.WARNING,
        message=f"field(s) {names} of the data are not used: the lines are read as {read}",
        fix="labels (-100: not counted) or loss_mask (0/1) say which tokens the loss counts"
        if tokens
        else "--text-field, --messages-field, --prompt-field and --completion-field name the fields to read",
    )


def _parse_lines(
    lines: Iterator[bytes],
    shown: str,
    problems: list[Diagnostic],
    found: tuple[RowsWriter, RowsWriter, dict[str, None], dict[tuple[str, tuple[str, ...]], None]],
    *,
    vocab_size: int,
    min_tokens: int,
    max_tokens: int | None,
    fields: DataFields | None = None,
    tokenizer: Tokenizer | None = None,
    records: bool = False,
    row_length: int | None = None,
    documents: list[int] | None = None,
) -> None:
    """Each line (or, with ``records``, each row of a dataset) parsed into ``found``; the
    problems of the first ``MAX_REPORTED`` bad ones into ``problems``, each at its line."""
    for line_no, raw in enumerate(lines, start=1):
        try:
            if records:
                record = raw
            else:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                record = _decoded(line)
            parsed = parse_record(record, vocab_size, min_tokens, max_tokens, fields, tokenizer, row_length)
            pieces = [parsed[:2]] if row_length is None else rows_of(parsed[0], parsed[1], row_length)
            for ids, mask in pieces:
                found[0].append(ids)
                found[1].append(mask)
            found[2].update(dict.fromkeys(parsed[2]))
            if isinstance(record, dict):  # parse_record took it: it is one
                found[3].setdefault(record_format(record, fields or DataFields()))
            if documents is not None:
                documents[0] += 1
        except UnicodeDecodeError as exc:
            problems.append(_bad(shown, line_no, "data-json", f"byte {exc.start + 1} is not valid UTF-8", _UTF8))
        except BadRecord as bad:
            problems.append(_bad(shown, line_no, bad.rule, bad.message, bad.fix))
        if len(problems) >= MAX_REPORTED:  # a binary file or a device: stop reading, not one line per byte
            problems.append(
                Diagnostic(
                    rule="data-file",
                    loc=SourceLoc(path=shown),
                    message=f"{MAX_REPORTED} bad {'rows' if records else 'lines'}: the rest of the file was not read",
                    fix=_UTF8,
                )
            )
            break


def _bad(shown: str, line_no: int, rule: str, message: str, fix: str) -> Diagnostic:
    return Diagnostic(rule=rule, loc=SourceLoc(path=shown, line=line_no, column=1), message=message, fix=fix)


def write_tokens(data: TokenDataset, path: str | Path) -> None:
    """The checked dataset in a compact form for the workers: the launcher read (and checked)
    ``--data`` once; its workers map this copy instead of reading the user's path again (a
    pipe can be read once only, a file can change in between). A header line (padded to 8
    bytes), then every row's offset, whether it has a mask, the masks and the tokens, each
    written from its own file in pieces: a dataset larger than memory passes through."""
    rows, masks = data.sequences, data.masks
    head = {
        "path": data.path,
        "count": len(rows),
        "masked": masks is not None,
        "unused": list(data.unused),
        "documents": data.documents,
    }
    line = json.dumps(head).encode()
    with open(path, "wb") as f:
        f.write(line + b" " * (-(len(line) + 1) % 8) + b"\n")
        rows.offsets.tofile(f)
        rows.copy_to(f)
        if masks is not None:
            masks.offsets.tofile(f)
            (masks.present or array("b", [1] * len(masks))).tofile(f)
            f.write(b"\0" * (-len(masks) % 8))
            masks.copy_to(f)


def read_tokens(path: str | Path) -> TokenDataset:
    """What ``write_tokens`` wrote, mapped in place (the rows read as they are used)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = json.loads(f.readline())
        count = head["count"]
        offsets = array("q")
        offsets.fromfile(f, count + 1)
        rows = TokenRows(path, offsets, "q", start=f.tell())
        masks = None
        if head.get("masked"):
            f.seek(rows.start + rows.nbytes)
            mask_offsets, present = array("q"), array("b")
            mask_offsets.fromfile(f, count + 1)
            present.fromfile(f, count)
            f.seek(f.tell() + (-count % 8))
            masks = TokenRows(path, mask_offsets, "b", start=f.tell(), present=present)
    return TokenDataset(
        sequences=rows,
        path=head["path"],
        masks=masks,
        unused=tuple(head.get("unused", ())),
        documents=head.get("documents"),
    )


def synthetic_batch(step: int, *, seed: int, batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Learnable synthetic tokens: each row counts from a random start with a random small
    stride (mod vocab), so a working training loop visibly lowers the loss."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % vocab_size


def dataset_batch(
    data: TokenDataset,
    step: int,
    *,
    batch_size: int,
    seq_len: int | None,
    pad_id: int = 0,
    order: RowOrder | None = None,
) -> dict[str, torch.Tensor]:
    """Step ``step``'s rows in ``order`` (``job.data_order``; None: file order, cycling), each
    cut to ``seq_len`` (None: as they are) and
    right-padded to the longest: ``input_ids``, ``attention_mask`` and, for data with loss
    masks, ``token_mask`` (the tokens the loss counts; never position 0, which nothing predicts).
    The engine pads further to the layout's multiple, or packs."""
    order = order or RowOrder(rows=len(data.sequences), shuffle=False)
    return rows_batch(data, order.batch(step, batch_size), seq_len=seq_len, pad_id=pad_id)


def rows_batch(
    data: TokenDataset, picked: list[int], *, seq_len: int | None, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """The rows ``picked`` as a batch (``dataset_batch``'s, which says what it holds)."""
    rows = [data.sequences[i][:seq_len] for i in picked]
    ids, attention = padded_rows(rows, pad_id=pad_id)
    batch = {"input_ids": ids, "attention_mask": attention}
    if data.masks is not None:
        token_mask = torch.zeros_like(ids)
        for row, i in enumerate(picked):
            mask = data.masks[i]
            counted = mask[:seq_len] if mask is not None else (1,) * len(rows[row])
            token_mask[row, : len(counted)] = torch.tensor(counted, dtype=torch.long)
        token_mask[:, 0] = 0
        batch["token_mask"] = token_mask
    return batch


def truncated(data: TokenDataset, seq_len: int | None) -> int:
    """How many sequences ``--seq-len`` cuts (said in the run's log)."""
    return 0 if seq_len is None else sum(n > seq_len for n in data.lengths())


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
