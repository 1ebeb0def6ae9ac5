"""One record of a user's data -- a JSONL line, a row of a parquet or arrow file -- as the token
ids a run trains on and which of them the loss counts.

A record holds ``input_ids`` (with ``labels``, -100 where a token does not count, or a
``loss_mask``), or text tokenized with the model folder's tokenizer: ``text`` (every token
counts), ``messages`` rendered with its chat template (the assistant's turns count), or
``prompt`` + ``completion`` (the completion counts). Field names as TRL's, renamed with
``DataFields``. Every problem is a ``BadRecord`` naming the rule, for the record's line or row.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXAMPLE = 'write {"input_ids": [1, 2, 3]}'


class BadRecord(Exception):
    """Why one record of the data is not a sequence (rule, message, fix)."""

    def __init__(self, rule: str, message: str, fix: str = EXAMPLE):
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
            raise BadRecord(
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
            raise BadRecord("data-text", f"{fields.text!r} must be a string")
        tok = tokenizer.get()
        return _with_eos(_token_ids(tok(text)), tok), None
    if fields.messages in record:
        return _chat(record[fields.messages], fields.messages, tokenizer.get())
    if fields.prompt in record and fields.completion in record:
        prompt, completion = record[fields.prompt], record[fields.completion]
        if isinstance(prompt, list) and isinstance(completion, list):  # TRL's conversational prompt-completion
            chat = [_message(m, f"{fields.prompt}[{i}]") for i, m in enumerate(prompt)]
            chat += [_message(m, f"{fields.completion}[{i}]") for i, m in enumerate(completion)]
            return _chat(chat, f"{fields.prompt} + {fields.completion}", tokenizer.get(), counted_from=len(prompt))
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise BadRecord(
                "data-text",
                f"{fields.prompt!r} and {fields.completion!r} must be strings (text) or lists of messages (a chat); "
                f"found {_kind(prompt)} and {_kind(completion)}",
                "give both as text, or both as lists of messages",
            )
        tok = tokenizer.get()
        head = _token_ids(tok(prompt))
        tail = _with_eos(_token_ids(tok(completion, add_special_tokens=False)), tok)
        return head + tail, (0,) * len(head) + (1,) * len(tail)  # completion-only loss
    raise BadRecord(
        "data-input-ids",
        f"the line has none of 'input_ids', {fields.text!r}, {fields.messages!r}, {fields.prompt!r} + "
        f"{fields.completion!r}",
    )


_MESSAGE_FIX = 'write each message as {"role": "user", "content": "..."}'
_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' mark of what the assistant says


def _kind(value: Any) -> str:
    """What a JSON value is, in JSON's words."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true / false"
    kinds = ((str, "a string"), ((int, float), "a number"), (list, "a list"), (dict, "an object"))
    return next((kind for types, kind in kinds if isinstance(value, types)), f"a {type(value).__name__}")


def _message(message: Any, where: str) -> dict:
    """One chat message as the template reads it: ``content`` a string -- a list of text parts
    (``[{"type": "text", "text": ...}]``, as OpenAI-style datasets hold them) joined by newlines,
    as vLLM renders them for a text model's template, so that training sees the prompt its
    rollouts saw -- or null beside ``tool_calls``. Other keys (``tool_calls``, ``name``, ...) go
    to the template as they are."""
    if isinstance(message, dict) and "role" not in message and {"from", "value"} <= message.keys():
        raise BadRecord(
            "data-messages",
            f"{where} is a ShareGPT message ({{'from': ..., 'value': ...}}); "
            "plancc reads {'role': ..., 'content': ...}",
            "rename from -> role (human -> user, gpt -> assistant) and value -> content, e.g. with datasets' map()",
        )
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        found = (
            f"an object of the keys {', '.join(map(repr, sorted(message)[:8]))}" if isinstance(message, dict) else ""
        )
        raise BadRecord(
            "data-messages",
            f"{where} must be an object with a 'role' string; found {found or _kind(message)}",
            _MESSAGE_FIX,
        )
    content = message.get("content")
    if isinstance(content, str) or (content is None and message.get("tool_calls")):
        return message
    if isinstance(content, list) and content and all(isinstance(part, dict) for part in content):
        other = [part for part in content if part.get("type") != "text" or not isinstance(part.get("text"), str)]
        if not other:
            return {**message, "content": "\n".join(part["text"] for part in content)}
        raise BadRecord(
            "data-messages",
            f"{where}'s content holds a part of type {other[0].get('type')!r}: plancc trains text models, "
            "whose parts are {'type': 'text', 'text': ...}",
            "drop the line, or its parts that are not text",
        )
    raise BadRecord(
        "data-messages",
        f"{where}'s content is {_kind(content)}: a string, a list of text parts, or null beside 'tool_calls'",
        _MESSAGE_FIX,
    )


# a chat template is user code, run once per line (a few per turn): generous for any real one
TEMPLATE_SECONDS = 10


class _TemplateTooSlow(Exception):
    pass


@contextmanager
def _time_bound(seconds: float) -> Iterator[None]:
    """Raise ``_TemplateTooSlow`` in this thread once ``seconds`` pass (a real-time timer: the
    data is read on the launcher's main thread, before any worker starts). Elsewhere than the
    main thread no signal can reach the code: unbounded there. A real-time alarm the caller set
    (pytest-timeout's) is put back as it was, less the time taken."""
    pending, interval = signal.getitimer(signal.ITIMER_REAL)
    if threading.current_thread() is not threading.main_thread() or 0 < pending <= seconds:
        yield  # no signal reaches this thread; or the caller's own alarm (a test's timeout) comes first
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise _TemplateTooSlow

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        if pending:  # the caller's alarm, with the time the render took off it
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - started), 1e-3), interval)


def _chat(messages: Any, name: str, tok: Any, counted_from: int = 0) -> tuple[list[int], tuple[int, ...]]:
    """A chat rendered with the tokenizer's template; the loss counts the assistant's turns (from
    message ``counted_from`` on: a conversational completion's, not its prompt's). A
    template that marks them (``{% generation %}``) says which tokens they are; otherwise each
    turn's tokens are those its rendering adds to the conversation before it rendered with the
    generation prompt (the prefix each reply is sampled after), which needs a template that renders
    a conversation as an extension of each of its prefixes."""
    if not isinstance(messages, list) or not messages:
        found = "an empty list" if isinstance(messages, list) else _kind(messages)
        raise BadRecord(
            "data-messages",
            f"{name!r} must be a non-empty list of messages; found {found}",
            "drop the line, or give it its messages",
        )
    messages = [_message(m, f"{name}[{i}]") for i, m in enumerate(messages)]
    if not getattr(tok, "chat_template", None):
        raise BadRecord(
            "data-messages",
            "the tokenizer has no chat template to render messages with",
            "give --model a folder whose tokenizer has one (chat_template.jinja), or the lines as text / prompt + "
            "completion",
        )

    def render(part: list[dict], prompt: bool, **extra: Any) -> Any:
        try:
            with _time_bound(TEMPLATE_SECONDS):
                return tok.apply_chat_template(part, tokenize=True, add_generation_prompt=prompt, **extra)
        except _TemplateTooSlow:
            raise BadRecord(
                "data-messages",
                f"the chat template did not finish rendering this line's messages within {TEMPLATE_SECONDS} s "
                "(a template is a program: one that loops without end never finishes)",
                "fix the template's loops (chat_template.jinja in the --model folder), or give the lines as input_ids",
            ) from None
        except Exception as exc:  # the template's own refusal (a role it does not know)
            raise BadRecord(
                "data-messages",
                f"the chat template failed: {type(exc).__name__}: {str(exc)[:200]}",
                "give the messages the roles and keys the model's template renders",
            ) from None

    if isinstance(tok.chat_template, str) and _GENERATION_MARK.search(tok.chat_template):
        # the template says which tokens the assistant generates: transformers' assistant mask
        out = render(messages, False, return_dict=True, return_assistant_tokens_mask=True)
        ids, marked = _token_ids(out), [int(m) for m in out["assistant_masks"]]
        if counted_from:  # a conversational completion: its prompt's turns do not count
            prompt = _token_ids(render(messages[:counted_from], True))
            if ids[: len(prompt)] != prompt:
                raise _not_an_extension(counted_from)
            marked[: len(prompt)] = [0] * len(prompt)
        return ids, tuple(marked)
    ids = _token_ids(render(messages, False))
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant" or turn < counted_from:
            continue
        before, through = _token_ids(render(messages[:turn], True)), _token_ids(render(messages[: turn + 1], False))
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise _not_an_extension(turn)
        mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    return ids, tuple(mask)


def _not_an_extension(turn: int) -> BadRecord:
    return BadRecord(
        "data-messages",
        f"the chat template does not render message {turn} as an extension of the ones before it (as "
        "Qwen3's renders a last turn's thinking and drops an earlier one's): the assistant's tokens "
        "cannot be told apart",
        "give the tokenizer a template with {% generation %} ... {% endgeneration %} around the assistant's "
        "turns (transformers' assistant mask, which plancc then reads), or tokenize with labels yourself",
    )


def _loss_mask(record: dict, ids: list[int]) -> tuple[int, ...] | None:
    """Which tokens of ``ids`` the loss counts, from ``labels`` or ``loss_mask`` (None: all)."""
    if "labels" in record and "loss_mask" in record:
        raise BadRecord("data-mask", "the line has both 'labels' and 'loss_mask': give one", "keep one of them")
    if "labels" in record:
        labels = record["labels"]
        if not isinstance(labels, list) or len(labels) != len(ids):
            raise BadRecord("data-mask", "'labels' must be a list as long as 'input_ids'")
        wrong = [i for i, (t, label) in enumerate(zip(ids, labels, strict=True)) if label not in (t, IGNORE_INDEX)]
        if wrong:
            raise BadRecord(
                "data-mask",
                f"labels[{wrong[0]}] is {labels[wrong[0]]!r}: a label is the token itself or {IGNORE_INDEX} "
                "(transformers shifts them; the loss predicts input_ids)",
                f"write input_ids[i] or {IGNORE_INDEX} at every position",
            )
        return tuple(int(label != IGNORE_INDEX) for label in labels)
    if "loss_mask" in record:
        mask = record["loss_mask"]
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) or m is True for m in mask):
            raise BadRecord("data-mask", "'loss_mask' must be a list of 0 and 1 as long as 'input_ids'")
        return tuple(int(m) for m in mask)
    return None


def _unpadded(record: dict) -> dict:
    """A pre-tokenized record with its ``attention_mask`` honoured: the padding it marks 0
    (``tokenizer(..., padding="max_length")``, left or right) cut off its ids, labels and loss
    mask, so that the run trains on the tokens the mask attends, as transformers would."""
    attention = record.get("attention_mask")
    if attention is None:
        return record
    ids = record["input_ids"]
    if not isinstance(attention, list) or not isinstance(ids, list) or len(attention) != len(ids):
        raise BadRecord("data-mask", "'attention_mask' must be a list of 0 and 1 as long as 'input_ids'")
    if any(m not in (0, 1) or m is True or m is False for m in attention):
        raise BadRecord("data-mask", "'attention_mask' must be a list of 0 and 1 as long as 'input_ids'")
    kept = [i for i, m in enumerate(attention) if m == 1]
    if not kept:
        raise BadRecord("data-mask", "the line's attention_mask attends no token", "drop the line")
    start, end = kept[0], kept[-1] + 1
    if len(kept) != end - start:
        raise BadRecord(
            "data-mask",
            f"the line's attention_mask leaves out token {next(i for i in range(start, end) if attention[i] == 0)} "
            "inside the attended tokens: plancc reads a row as one sequence, padded at its ends only",
            "split the line where its mask breaks (packed documents: one line each), or drop attention_mask",
        )
    cut = {
        key: record[key][start:end] for key in ("input_ids", "labels", "loss_mask") if isinstance(record.get(key), list)
    }
    return {**record, **cut}


def record_format(record: dict[str, Any], fields: DataFields) -> tuple[str, tuple[str, ...]]:
    """What a (parsed) record was read as, and the fields that format reads: token ids, text, a
    chat, or a prompt and its completion (the unused-field warning names them)."""
    if "input_ids" in record:
        return "token ids", KNOWN_FIELDS
    if fields.text in record:
        return "text", (fields.text,)
    if fields.messages in record:
        return "a chat", (fields.messages,)
    return "a prompt + completion", (fields.prompt, fields.completion)


def parse_record(
    record: Any,
    vocab_size: int,
    min_tokens: int,
    max_tokens: int | None,
    fields: DataFields | None = None,
    tokenizer: Tokenizer | None = None,
    row_length: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...] | None, list[str]]:
    """(token ids, loss mask or None, the record's fields the run does not read). With
    ``row_length`` (a training run's ``--seq-len``) a chat or a prompt + completion longer than
    it is refused: it is never cut into rows (``rows_of`` cuts documents: text and token ids)."""
    fields = fields or DataFields()
    if not isinstance(record, dict):
        raise BadRecord("data-input-ids", "the line is not a JSON object")
    # a column a table holds for other rows is null in this one (datasets' JSON reader, a parquet
    # made from JSON lines of several kinds): absent, as in the JSON line it was made from
    record = {key: value for key, value in record.items() if value is not None}
    text_mask: tuple[int, ...] | None = None
    if "input_ids" in record:
        record = _unpadded(record)
        ids = record["input_ids"]
    else:  # text, a chat, or a prompt and its completion: the model folder's tokenizer
        ids, text_mask = _tokenized(record, fields, tokenizer or Tokenizer(None))
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRecord("data-input-ids", "'input_ids' must be a non-empty list of integers")
    if len(ids) < min_tokens:  # a lone token predicts nothing: training on it would report a loss of 0
        raise BadRecord(
            "data-too-short",
            f"the line has {len(ids)} token; training needs at least {min_tokens} "
            "(one to predict from, one to predict)",
            "drop lines of one token or join them to others",
        )
    if max_tokens is not None and len(ids) > max_tokens:  # a batch pads every line to its longest one
        raise BadRecord(
            "data-too-long",
            f"the line has {len(ids)} tokens; the model takes at most {max_tokens} (max_position_embeddings)",
            "split or truncate the line",
        )
    out_of_range = [t for t in ids if t < 0 or t >= vocab_size]
    if out_of_range:
        raise BadRecord(
            "data-token-range",
            f"token id {out_of_range[0]} is outside the vocabulary [0, {vocab_size})",
            "tokenize with the model's own tokenizer",
        )
    whole = "input_ids" not in record and fields.text not in record  # a chat, a prompt + completion
    if whole and row_length is not None and len(ids) > row_length:
        raise BadRecord(
            "data-too-long",
            f"the {'chat' if fields.messages in record else 'prompt + completion'} has {len(ids)} tokens, more "
            f"than --seq-len {row_length}: a conversation is never cut into rows (a later row would lose the "
            "turns it answers; text and token ids are)",
            f"raise --seq-len to at least {len(ids)}, or drop or shorten the line",
        )
    mask = _loss_mask(record, ids) if "input_ids" in record else text_mask
    if mask is not None and min_tokens > 1 and not any(mask[1:]):  # position 0 predicts nothing
        raise BadRecord(
            "data-mask",
            "the loss counts no token of this line (every label -100, or loss_mask 0, after the first)",
            "drop the line, or count its completion",
        )
    read = (*KNOWN_FIELDS, *fields.used())
    return tuple(ids), mask, [key for key in record if key not in read]


def rows_of(
    ids: tuple[int, ...], mask: tuple[int, ...] | None, length: int
) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
    """A document longer than ``length`` tokens as rows of ``length``, every token kept: each row
    starts at the token the row before ended on (a row's first position predicts nothing, so
    every token after the document's first is predicted exactly once, as in the whole
    document -- each row sees only its own row as context). A row whose mask counts nothing
    after its first position trains nothing and is left out."""
    if len(ids) <= length:
        return [(ids, mask)]
    rows = []
    start = 0
    while True:
        end = min(start + length, len(ids))
        piece = None if mask is None else mask[start:end]
        if piece is None or any(piece[1:]):
            rows.append((ids[start:end], piece))
        if end == len(ids):
            return rows
        start = end - 1
