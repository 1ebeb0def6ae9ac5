"""YAML text -> plain data plus a line/column mark for every key and value.

PyYAML's composer keeps marks on nodes but its constructor throws them away; we walk the
node graph ourselves so that schema errors and model checks can point at the exact key or
value a user wrote. Duplicate keys, which PyYAML silently resolves to the last one, are
reported here because by the time data is a dict the first occurrence is gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import Diagnostic, PlanError, SourceLoc
from ..inputs import InputKind, read_input

# The largest plan read: the shipped ones are a few KiB; a file of megabytes is another file.
PLAN_LIMIT_BYTES = 4 << 20
PLAN_INPUT = InputKind(
    what="plan",
    fix="pass a readable YAML plan file; shipped plans live in plans/ (qwen3.yaml, llama.yaml, gemma3.yaml)",
)

JsonPath = tuple[str | int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceDoc:
    """A parsed YAML document and where each piece of it came from."""

    path: str
    data: Any
    # JSON path -> location of the value; for mapping entries also the key's location.
    value_locs: dict[JsonPath, SourceLoc]
    key_locs: dict[JsonPath, SourceLoc]
    text: str = ""  # the YAML itself: a launcher hands it to its workers rather than have them read the path again

    def loc(self, json_path: JsonPath, *, key: bool = False) -> SourceLoc:
        """The closest known location for a JSON path (walking up to the document root)."""
        table = self.key_locs if key else self.value_locs
        json_path = tuple(json_path)
        while json_path:
            if json_path in table:
                return table[json_path]
            if key and json_path in self.value_locs:
                return self.value_locs[json_path]
            json_path = json_path[:-1]
        return self.value_locs.get((), SourceLoc(path=self.path, line=1, column=1))


def _loc(path: str, mark: yaml.Mark | None) -> SourceLoc:
    if mark is None:
        return SourceLoc(path=path)
    return SourceLoc(path=path, line=mark.line + 1, column=mark.column + 1)


# A plan is a few hundred YAML nodes. Aliases repeat their anchor's content wherever they
# appear, so 480 bytes of nested aliases can stand for billions of nodes ("billion laughs"):
# the walk counts the nodes it expands and stops with a diagnostic at the alias that passed
# the budget, in milliseconds, instead of expanding for minutes.
MAX_EXPANDED = 100_000
_MERGE_TAG = "tag:yaml.org,2002:merge"
# libyaml's parser when PyYAML was built with it (its wheels are): a few MB of plan parse in
# seconds instead of tens of seconds; the same nodes, marks and errors either way.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _TooLarge(Exception):
    def __init__(self, node: yaml.Node):
        self.node = node


class _Walker:
    def __init__(self, path: str, loader: Any):
        self.path = path
        self.loader = loader
        self.value_locs: dict[JsonPath, SourceLoc] = {}
        self.key_locs: dict[JsonPath, SourceLoc] = {}
        self.problems: list[Diagnostic] = []
        self.expanded = 0  # nodes walked again because an alias names them
        self._seen: set[int] = set()
        self._merged: dict[int, int] = {}  # mapping node -> how many of its pairs came from '<<'
        # node -> its location: an alias walks its anchor's nodes again (up to MAX_EXPANDED of
        # them), and each would otherwise build the same frozen SourceLoc anew
        self._locs: dict[int, SourceLoc] = {}

    def walk(self, node: yaml.Node, at: JsonPath) -> Any:
        if id(node) in self._seen:
            self.expanded += 1
            if self.expanded > MAX_EXPANDED:
                raise _TooLarge(node)
        else:
            self._seen.add(id(node))
        loc = self._locs.get(id(node))
        if loc is None:
            loc = self._locs[id(node)] = _loc(self.path, node.start_mark)
        self.value_locs[at] = loc
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, at)
        if isinstance(node, yaml.SequenceNode):
            return [self.walk(item, at + (i,)) for i, item in enumerate(node.value)]
        return self._scalar(node)

    def _scalar(self, node: yaml.Node) -> Any:
        try:
            return self.loader.construct_object(node, deep=True)
        except ValueError as exc:  # an integer past Python's digit limit, a bad timestamp, ...
            self.problems.append(
                Diagnostic(
                    rule="yaml-value",
                    loc=_loc(self.path, node.start_mark),
                    message=f"value cannot be read: {str(exc).split(';')[0][:200]}",
                    fix="write a plain string, number or boolean",
                )
            )
            return None

    def _merge(self, node: yaml.MappingNode) -> int:
        """Resolve YAML merge keys (``<<``) once per node; how many pairs they put first."""
        if id(node) not in self._merged:
            explicit = sum(1 for key, _ in node.value if key.tag != _MERGE_TAG)
            self.loader.flatten_mapping(node)
            self._merged[id(node)] = len(node.value) - explicit
        return self._merged[id(node)]

    def _mapping(self, node: yaml.MappingNode, at: JsonPath) -> dict[str, Any]:
        merged = self._merge(node)
        out: dict[str, Any] = {}
        from_merge: set[str] = set()
        for i, (key_node, value_node) in enumerate(node.value):
            key = self._key(key_node)
            if key in out and key not in from_merge:
                first = self.key_locs[at + (key,)]
                self.problems.append(
                    Diagnostic(
                        rule="duplicate-key",
                        loc=_loc(self.path, key_node.start_mark),
                        message=f"duplicate key {key!r} (first defined at line {first.line}); "
                        "YAML would silently keep only the last one",
                        fix="remove one of the two entries or merge them",
                    )
                )
                continue
            if key in out and i < merged:  # an earlier merged mapping wins over a later one
                continue
            # a key written beside '<<: *base' overrides the merged one: that is what merge keys are for
            from_merge.discard(key)
            if i < merged:
                from_merge.add(key)
            self.key_locs[at + (key,)] = _loc(self.path, key_node.start_mark)
            out[key] = self.walk(value_node, at + (key,))
        return out

    def _key(self, key_node: yaml.Node) -> str:
        key = self._scalar(key_node)
        if isinstance(key, str):
            return key
        self.problems.append(
            Diagnostic(
                rule="yaml-key-type",
                loc=_loc(self.path, key_node.start_mark),
                message=f"key {key!r} is a {type(key).__name__}; plan keys are strings",
                fix=f"quote the key: '{key}'",
            )
        )
        return str(key)


def _syntax_error(path: str, exc: Exception, text: str = "") -> Diagnostic:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context, opened = getattr(exc, "context", None) or "", getattr(exc, "context_mark", None)
    if opened and context.startswith(("while parsing a flow", "while scanning a quoted")) and mark:
        # an unclosed '[', '{' or quote: the parser gives up far below (often lines later);
        # the place to fix is where the collection or string was opened
        gave_up = f"{mark.line + 1}:{mark.column + 1}"
        what = context.removeprefix("while parsing a ").removeprefix("while scanning a ")
        problem = f"this {what} is never closed ({problem} at {gave_up})"
        mark = opened
    if mark:
        loc = _loc(path, mark)
    elif isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow
        before = text[: exc.position]
        loc = SourceLoc(path=path, line=before.count("\n") + 1, column=exc.position - (before.rfind("\n") + 1) + 1)
        problem = f"character {exc.character!r} is not allowed in YAML"
    else:
        loc = SourceLoc(path=path, line=1, column=1)
    return Diagnostic(
        rule="yaml-syntax",
        loc=loc,
        message=f"YAML syntax error: {problem}",
        fix="correct the YAML at this position (check indentation, colons and quotes)",
    )


def parse_yaml(text: str, path: str) -> SourceDoc:
    """Parse YAML text; raise ``PlanError`` on syntax errors, duplicate keys or an empty file."""
    loader = None
    try:
        loader = _LOADER(text)  # the reader already rejects control characters here
        root = loader.get_single_node()
        if root is None:
            raise PlanError(
                [
                    Diagnostic(
                        rule="empty-plan",
                        loc=SourceLoc(path=path, line=1, column=1),
                        message="the plan file is empty",
                        fix="start from plans/qwen3.yaml; a plan needs at least "
                        "'plancc', 'name', 'architectures' and 'tensor_parallel'",
                    )
                ]
            )
        walker = _Walker(path, loader)
        data = walker.walk(root, ())
    except yaml.YAMLError as exc:
        raise PlanError([_syntax_error(path, exc, text)]) from None
    except _TooLarge as exc:
        raise PlanError(
            [
                Diagnostic(
                    rule="yaml-too-large",
                    loc=_loc(path, exc.node.start_mark),
                    message=f"aliases here repeat more than {MAX_EXPANDED} YAML nodes "
                    "(aliases repeat the content of their anchors)",
                    fix="write the plan out without nested aliases; a plan is a few hundred nodes",
                )
            ]
        ) from None
    except RecursionError:
        raise PlanError(
            [
                Diagnostic(
                    rule="yaml-syntax",
                    loc=SourceLoc(path=path, line=1, column=1),
                    message="the YAML document is nested too deeply to be a plan",
                    fix="a plan is a mapping of at most three levels",
                )
            ]
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
    if walker.problems:
        raise PlanError(walker.problems)
    return SourceDoc(path=path, data=data, value_locs=walker.value_locs, key_locs=walker.key_locs, text=text)


def read_yaml(path: str | Path) -> SourceDoc:
    """Read and parse a plan file; unreadable files become diagnostics too."""
    shown = str(path)
    raw = read_input(path, PLAN_INPUT, limit=PLAN_LIMIT_BYTES)  # a FIFO, a device, a folder: one line, no hang
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise PlanError(
            [
                Diagnostic(
                    rule="yaml-syntax",
                    loc=SourceLoc(path=shown, line=line, column=col),
                    message=f"byte 0x{raw[exc.start]:02x} is not valid UTF-8",
                    fix="save the plan as UTF-8 text",
                )
            ]
        ) from None
    return parse_yaml(text, shown)
