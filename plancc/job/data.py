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
from typing import Any

import torch

from ..errors import Diagnostic, PlanError, Severity, SourceLoc
from ..inputs import InputKind, read_lines


class DataError(PlanError):
    """Bad training data: reported as FILE:LINE diagnostics before any step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenDataset:
    """Pre-tokenized sequences, each a list of ids, with where each came from.

    ``masks``: per sequence, which tokens the loss counts (1) -- from a line's ``labels``
    (-100: not counted, transformers' convention) or ``loss_mask`` -- or None where every token
    counts; None for the whole dataset when no line has one. ``unused``: fields the lines hold
    that the run does not read (said once, in a warning)."""

    sequences: tuple[tuple[int, ...], ...]
    path: str = "<synthetic>"
    masks: tuple[tuple[int, ...] | None, ...] | None = None
    unused: tuple[str, ...] = ()


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


# The fields a line of pre-tokenized data may hold; any other is named in one warning.
KNOWN_FIELDS = ("input_ids", "labels", "loss_mask", "attention_mask")
IGNORE_INDEX = -100  # transformers' label of a token the loss does not count


@dataclass(frozen=True, kw_only=True, slots=True)
class DataFields:
    """Where a line keeps its text, as TRL names them: ``text`` (every token counts),
    ``messages`` (a chat: the assistant's turns count), or ``prompt`` + ``completion`` (the
    completion counts). Renamed with ``--text-field`` and the like."""

    text: str = "text"
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"

    @classmethod
    def of(cls, names: dict[str, str] | None) -> DataFields:
        return cls(**(names or {}))

    def used(self) -> tuple[str, ...]:
        return (self.text, self.messages, self.prompt, self.completion)


class Tokenizer:
    """The model folder's tokenizer, loaded the first time a line needs it (pre-tokenized data
    needs none), or the reason there is none."""

    def __init__(self, folder: str | None) -> None:
        self.folder, self._loaded, self._problem = folder, None, ""

    def get(self) -> Any:
        if self._loaded is None and not self._problem:
            self._loaded, self._problem = _load_tokenizer(self.folder)
        if self._problem:
            raise _BadLine(
                "data-tokenizer", self._problem, "pass --model a Hugging Face folder with its tokenizer files"
            )
        return self._loaded


def _load_tokenizer(folder: str | None) -> tuple[Any, str]:
    has_files = folder is not None and any(
        (Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if not has_files:
        where = f"the model folder {folder}" if folder else "--model (a preset, no folder)"
        return None, f"the line holds text, and {where} has no tokenizer to tokenize it with"
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder), ""
    except Exception as exc:  # whatever a broken tokenizer folder raises
        return None, f"the tokenizer of {folder} could not be loaded: {type(exc).__name__}: {str(exc)[:200]}"


def _token_ids(encoded: Any) -> list[int]:
    """``input_ids`` of what a tokenizer returned (a list, or a BatchEncoding: transformers 5)."""
    ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
    return [int(t) for t in ids]


def _with_eos(ids: list[int], tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids + [eos] if isinstance(eos, int) and (not ids or ids[-1] != eos) else ids


def _tokenized(record: dict, fields: DataFields, tokenizer: Tokenizer) -> tuple[list[int], tuple[int, ...] | None]:
    """(ids, loss mask or None) of a line that holds text rather than token ids."""
    if fields.text in record:
        text = record[fields.text]
        if not isinstance(text, str):
            raise _BadLine("data-text", f"{fields.text!r} must be a string")
        tok = tokenizer.get()
        return _with_eos(_token_ids(tok(text)), tok), None
    if fields.messages in record:
        return _chat(record[fields.messages], fields.messages, tokenizer.get())
    if fields.prompt in record and fields.completion in record:
        prompt, completion = record[fields.prompt], record[fields.completion]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise _BadLine("data-text", f"{fields.prompt!r} and {fields.completion!r} must be strings")
        tok = tokenizer.get()
        head = _token_ids(tok(prompt))
        tail = _with_eos(_token_ids(tok(completion, add_special_tokens=False)), tok)
        return head + tail, (0,) * len(head) + (1,) * len(tail)  # completion-only loss
    raise _BadLine(
        "data-input-ids",
        f"the line has none of 'input_ids', {fields.text!r}, {fields.messages!r}, {fields.prompt!r} + "
        f"{fields.completion!r}",
    )


def _chat(messages: Any, name: str, tok: Any) -> tuple[list[int], tuple[int, ...]]:
    """A chat rendered with the tokenizer's template; the loss counts the assistant's turns:
    each turn's tokens are those its rendering adds to the conversation before it rendered with
    the generation prompt (the prefix each reply is sampled after, as TRL masks them)."""
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise _BadLine("data-messages", f"{name!r} must be a list of {{'role': ..., 'content': ...}} with strings")
    if not getattr(tok, "chat_template", None):
        raise _BadLine("data-messages", "the tokenizer has no chat template to render messages with")

    def render(part: list[dict], prompt: bool) -> list[int]:
        try:
            return _token_ids(tok.apply_chat_template(part, tokenize=True, add_generation_prompt=prompt))
        except Exception as exc:  # the template's own refusal (a role it does not know)
            raise _BadLine(
                "data-messages", f"the chat template failed: {type(exc).__name__}: {str(exc)[:200]}"
            ) from None

    ids = render(messages, False)
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:turn], True), render(messages[: turn + 1], False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise _BadLine(
                "data-messages",
                f"the chat template does not render message {turn} as an extension of the ones before it: "
                "the assistant's tokens cannot be told apart",
                "use a template that renders a conversation turn by turn, or tokenize with labels yourself",
            )
        mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    return ids, tuple(mask)


def _loss_mask(record: dict, ids: list[int]) -> tuple[int, ...] | None:
    """Which tokens of ``ids`` the loss counts, from ``labels`` or ``loss_mask`` (None: all)."""
    if "labels" in record and "loss_mask" in record:
        raise _BadLine("data-mask", "the line has both 'labels' and 'loss_mask': give one", "keep one of them")
    if "labels" in record:
        labels = record["labels"]
        if not isinstance(labels, list) or len(labels) != len(ids):
            raise _BadLine("data-mask", "'labels' must be a list as long as 'input_ids'")
        wrong = [i for i, (t, label) in enumerate(zip(ids, labels, strict=True)) if label not in (t, IGNORE_INDEX)]
        if wrong:
            raise _BadLine(
                "data-mask",
                f"labels[{wrong[0]}] is {labels[wrong[0]]!r}: a label is the token itself or {IGNORE_INDEX} "
                "(transformers shifts them; the loss predicts input_ids)",
                f"write input_ids[i] or {IGNORE_INDEX} at every position",
            )
        return tuple(int(label != IGNORE_INDEX) for label in labels)
    if "loss_mask" in record:
        mask = record["loss_mask"]
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) or m is True for m in mask):
            raise _BadLine("data-mask", "'loss_mask' must be a list of 0 and 1 as long as 'input_ids'")
        return tuple(int(m) for m in mask)
    return None


def _parse_line(
    line: str,
    vocab_size: int,
    min_tokens: int,
    max_tokens: int | None,
    fields: DataFields | None = None,
    tokenizer: Tokenizer | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...] | None, list[str]]:
    """(token ids, loss mask or None, the line's fields the run does not read)."""
    fields = fields or DataFields()
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _BadLine(
            "data-json", f"not valid JSON: {exc.msg} (column {exc.colno})", "write one JSON object per line"
        ) from None
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits; nesting past the stack
        why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise _BadLine("data-json", f"not readable as JSON: {why}") from None
    if not isinstance(record, dict):
        raise _BadLine("data-input-ids", "the line is not a JSON object")
    text_mask: tuple[int, ...] | None = None
    if "input_ids" in record:
        ids = record["input_ids"]
    else:  # text, a chat, or a prompt and its completion: the model folder's tokenizer
        ids, text_mask = _tokenized(record, fields, tokenizer or Tokenizer(None))
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
    mask = _loss_mask(record, ids) if "input_ids" in record else text_mask
    if mask is not None and min_tokens > 1 and not any(mask[1:]):  # position 0 predicts nothing
        raise _BadLine(
            "data-mask",
            "the loss counts no token of this line (every label -100, or loss_mask 0, after the first)",
            "drop the line, or count its completion",
        )
    read = (*KNOWN_FIELDS, *fields.used())
    return tuple(ids), mask, [key for key in record if key not in read]


def read_jsonl(
    path: str | Path,
    *,
    vocab_size: int,
    min_tokens: int = 1,
    max_tokens: int | None = None,
    wait_s: float | None = None,
    fields: DataFields | None = None,
    tokenizer: Tokenizer | None = None,
) -> TokenDataset:
    """Read ``{"input_ids": [...]}`` per line; report every bad line (the first
    ``MAX_REPORTED`` of them: the read stops there), then raise. Training reads with
    ``min_tokens=2``: a sequence of one token has nothing to predict. ``path`` may be a pipe
    (``--data <(...)``, ``/dev/stdin``): it is read once, as it arrives (``plancc.inputs``)."""
    shown = str(path)
    problems: list[Diagnostic] = []
    sequences: list[tuple[int, ...]] = []
    masks: list[tuple[int, ...] | None] = []
    unused: dict[str, None] = {}
    try:
        _parse_lines(
            read_lines(path, DATA_INPUT, max_line=MAX_LINE_BYTES, wait_s=wait_s),
            shown,
            problems,
            (sequences, masks, unused),
            vocab_size=vocab_size,
            min_tokens=min_tokens,
            max_tokens=max_tokens,
            fields=fields,
            tokenizer=tokenizer,
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
    return TokenDataset(
        sequences=tuple(sequences),
        path=shown,
        masks=tuple(masks) if any(m is not None for m in masks) else None,
        unused=tuple(unused),
    )


def unused_fields_warning(data: TokenDataset) -> Diagnostic | None:
    """The fields of the data the run does not read, named once (a ``text`` or ``mask`` field a
    user expected to matter trains without a word otherwise)."""
    if not data.unused:
        return None
    names = ", ".join(repr(name) for name in data.unused)
    return Diagnostic(
        rule="data-unused-field",
        loc=SourceLoc(path=data.path),
        severity=Severity.WARNING,
        message=f"field(s) {names} of the data are not used: the run reads {', '.join(KNOWN_FIELDS[:3])}",
        fix="labels (-100: not counted) or loss_mask (0/1) say which tokens the loss counts",
    )


def _parse_lines(
    lines: Iterator[bytes],
    shown: str,
    problems: list[Diagnostic],
    found: tuple[list[tuple[int, ...]], list[tuple[int, ...] | None], dict[str, None]],
    *,
    vocab_size: int,
    min_tokens: int,
    max_tokens: int | None,
    fields: DataFields | None = None,
    tokenizer: Tokenizer | None = None,
) -> None:
    for line_no, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            ids, mask, unused = _parse_line(line, vocab_size, min_tokens, max_tokens, fields, tokenizer)
            found[0].append(ids)
            found[1].append(mask)
            found[2].update(dict.fromkeys(unused))
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
    head = {"path": data.path, "count": len(lengths), "masked": data.masks is not None, "unused": list(data.unused)}
    with open(path, "wb") as f:
        f.write(json.dumps(head).encode() + b"\n")
        lengths.tofile(f)
        if data.masks is not None:  # one byte a token, 1 where every token of an unmasked line is
            pairs = zip(data.sequences, data.masks, strict=True)
            array("b", (m for seq, mask in pairs for m in (mask if mask is not None else (1,) * len(seq)))).tofile(f)
        tokens.tofile(f)


def read_tokens(path: str | Path) -> TokenDataset:
    """What ``write_tokens`` wrote."""
    with open(path, "rb") as f:
        head = json.loads(f.readline())
        lengths = array("q")
        lengths.fromfile(f, head["count"])
        flags = array("b")
        if head.get("masked"):
            flags.fromfile(f, sum(lengths))
        tokens = array("q")
        tokens.frombytes(f.read())
    sequences, masks, at = [], [], 0
    for n in lengths:
        sequences.append(tuple(tokens[at : at + n]))
        masks.append(tuple(flags[at : at + n]) if flags else None)
        at += n
    return TokenDataset(
        sequences=tuple(sequences),
        path=head["path"],
        masks=tuple(masks) if head.get("masked") else None,
        unused=tuple(head.get("unused", ())),
    )


def synthetic_batch(step: int, *, seed: int, batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Learnable synthetic tokens: each row counts from a random start with a random small
    stride (mod vocab), so a working training loop visibly lowers the loss."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % vocab_size


def dataset_batch(
    data: TokenDataset, step: int, *, batch_size: int, seq_len: int | None, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """Rows ``step*batch_size ...`` (cycling), each cut to ``seq_len`` (None: as they are) and
    right-padded to the longest: ``input_ids``, ``attention_mask`` and, for data with loss
    masks, ``token_mask`` (the tokens the loss counts; never position 0, which nothing predicts).
    The engine pads further to the layout's multiple, or packs."""
    n = len(data.sequences)
    picked = [(step * batch_size + row) % n for row in range(batch_size)]
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
    return 0 if seq_len is None else sum(len(s) > seq_len for s in data.sequences)


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
