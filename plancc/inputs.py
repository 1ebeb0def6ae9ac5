"""Read a file a user names as an input, once, with bounds: whatever the path turns out to be.

A plan or a data file is usually a regular file, but users also pass a pipe (``--data
<(tokenize ...)``, ``/dev/stdin``), and a typo can name a FIFO nobody writes to, a device that
never ends (``/dev/zero``) or a folder. Reading such a path the plain way hangs or exhausts
memory; reading it twice (once to check, once per worker) hangs or reads a different thing the
second time. So an input is read here once, into memory, with two bounds:

* a size bound (``limit`` bytes): an endless device is refused after ``limit`` bytes;
* a wait bound (``wait_s``): a pipe that stays silent that long -- no writer ever came, or it
  stopped writing without closing -- is refused, naming the path, instead of waiting forever.

The bytes read are what the checks check and what the launcher hands to its workers.
Pure standard library: the front end (plan files) and the job (data files) both read here.
"""

from __future__ import annotations

import os
import select
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import Diagnostic, PlanError, SourceLoc

WRITER_WAIT_S = 30.0  # how long a pipe may stay silent before its reader gives up
_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class InputKind:
    """What a user's input is called in messages (``plan``, ``data``) and the flag naming it."""

    what: str
    fix: str


def _refuse(path: str, kind: InputKind, rule: str, message: str, fix: str | None = None) -> PlanError:
    return PlanError([Diagnostic(rule=rule, loc=SourceLoc(path=path), message=message, fix=fix or kind.fix)])


def read_input(path: str | Path, kind: InputKind, *, limit: int, wait_s: float | None = None) -> bytes:
    """The whole content of ``path``: a regular file, a pipe or a character device. Raises
    ``PlanError`` (``file-not-found``, ``file-unreadable``, ``file-too-large``,
    ``file-no-writer``) instead of hanging, exhausting memory or tracing back."""
    parts: list[bytes] = []
    total = 0
    for chunk in _chunks(path, kind, wait_s=wait_s, size_limit=limit):
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise _too_large(str(path), kind, limit, f"more than {_size(limit)}")
    return b"".join(parts)


def read_lines(path: str | Path, kind: InputKind, *, max_line: int, wait_s: float | None = None) -> Iterator[bytes]:
    """The lines of ``path`` (split on ``\\n`` only), read as they arrive: a caller that stops
    early (too many bad lines) stops reading. A line longer than ``max_line`` bytes -- an
    endless device such as ``/dev/zero`` has one -- is refused."""
    pending = b""
    for chunk in _chunks(path, kind, wait_s=wait_s, size_limit=None):
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        yield from lines
        if len(pending) > max_line:
            raise _refuse(
                str(path),
                kind,
                "file-too-large",
                f"the {kind.what} file has a line longer than {_size(max_line)} (is this the file you meant?)",
            )
    yield pending


def _chunks(path: str | Path, kind: InputKind, *, wait_s: float | None, size_limit: int | None) -> Iterator[bytes]:
    shown = str(path)
    wait = WRITER_WAIT_S if wait_s is None else wait_s
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, unbounded
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _refuse(shown, kind, "file-not-found", f"no such {kind.what} file") from None
    except OSError as exc:
        raise _unreadable(shown, kind, exc) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise _refuse(shown, kind, "file-unreadable", f"the {kind.what} path is a folder, not a file")
        if stat.S_ISREG(mode):
            size = os.fstat(fd).st_size
            if size_limit is not None and size > size_limit:
                raise _too_large(shown, kind, size_limit, f"{size} bytes")
            os.set_blocking(fd, True)
            yield from _read(fd, shown, kind, wait=None)
        elif stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode):
            yield from _read(fd, shown, kind, wait=wait)
        else:
            raise _refuse(shown, kind, "file-unreadable", f"the {kind.what} path is not a file, a pipe or a device")
    except OSError as exc:
        raise _unreadable(shown, kind, exc) from None
    finally:
        os.close(fd)


def _unreadable(shown: str, kind: InputKind, exc: OSError) -> PlanError:
    return _refuse(shown, kind, "file-unreadable", f"cannot read the {kind.what} file: {exc.strerror or exc}")


def _too_large(shown: str, kind: InputKind, limit: int, found: str) -> PlanError:
    return _refuse(
        shown,
        kind,
        "file-too-large",
        f"the {kind.what} file holds {found}; plancc reads at most {_size(limit)} of a {kind.what} file",
        f"pass a {kind.what} file of at most {_size(limit)} (is this the file you meant?)",
    )


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def _read(fd: int, shown: str, kind: InputKind, *, wait: float | None) -> Iterator[bytes]:
    """Chunks to the end; ``wait``: a non-blocking pipe or device, polled, silent at most that long."""
    poller = select.poll() if wait is not None else None
    if poller is not None:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    got_any = False
    while True:
        if poller is not None and wait is not None:
            deadline = time.monotonic() + wait
            while not poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                if time.monotonic() >= deadline:
                    how = "its writer stopped writing without closing it" if got_any else "nothing was written to it"
                    raise _refuse(
                        shown,
                        kind,
                        "file-no-writer",
                        f"the {kind.what} path is a pipe and {how} for {wait:g} s",
                        f"start the program that writes {shown} first, or pass a regular file",
                    )
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:  # woken without data (a writer came and went before writing)
            continue
        if not chunk:
            return
        got_any = True
        yield chunk
