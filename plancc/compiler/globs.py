"""Module globs matched against a model's module tree, level by level.

A glob is a dotted path; within a segment the shell wildcards ``* ? [..]`` apply (``*`` never
crosses a dot); a whole segment ``**`` matches any number of segments. Matching walks the
tree of module names one segment at a time -- a literal segment is one dictionary lookup,
a wildcard segment looks only at the children of the modules matched so far -- so a plan is
compiled in time linear in the size of the model, however many layers it has, instead of
testing every rule against every module name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import cached_property

from torch import nn

from ..errors import closest

_WILDCARD = re.compile(r"[*?\[]")
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _segment_ok(segment: str) -> bool:
    depth = 0
    for ch in segment:
        if ch == "[":
            if depth:
                return False
            depth = 1
        elif ch == "]":
            depth = 0
    return depth == 0 and not ("**" in segment and segment != "**")


MAX_SEGMENTS = 64  # module paths of real models are under a dozen segments deep


ROOT = ""  # the plan key of the root module (torch's parallelize_module takes "" for it)


def glob_problem(pattern: str) -> str | None:
    """Why a glob is malformed, or None. (The schema catches characters; this, structure.)"""
    if pattern == ROOT:
        return None
    segments = pattern.split(".")
    if len(segments) > MAX_SEGMENTS:
        return f"has {len(segments)} segments; module paths are at most {MAX_SEGMENTS} deep"
    if any(not s for s in segments):
        return "has an empty path segment"
    for s in segments:
        if not _segment_ok(s):
            return f"segment {s!r} has an unclosed '[' or a '**' that is not a whole segment"
    return None


def generalize(name: str) -> str:
    """'model.layers.11.mlp' -> 'model.layers.*.mlp', the shape users write globs in."""
    return _INDEX.sub("*", name)


@dataclass(slots=True)
class _Node:
    order: int = -1  # position in named_modules(); -1 for the root
    name: str = ""
    children: dict[str, _Node] = field(default_factory=dict)


class ModuleTree:
    """The dotted module names of a model as a tree, built once per model and shared by
    every glob of a plan."""

    def __init__(self, names: Iterable[str] = ()):
        self._suggested = 0
        self.names: list[str] = []
        self.root = _Node()
        for name in names:
            if not name:
                continue
            node = self.root
            for segment in name.split("."):
                node = node.children.setdefault(segment, _Node())
            self._add(node, name)

    @classmethod
    def of(cls, model: nn.Module) -> ModuleTree:
        """The tree of ``model.named_modules()`` (same names, same order), built from the
        module hierarchy itself rather than by splitting every dotted name again."""
        tree = cls()
        seen = {id(model)}
        # (module, its parent's node, its attribute name, its dotted name), visited depth
        # first with children in order: exactly named_modules()' order
        stack: list[tuple[nn.Module, _Node, str, str]] = [
            (child, tree.root, key, key) for key, child in reversed(model._modules.items()) if child is not None
        ]
        while stack:
            module, parent, key, name = stack.pop()
            if id(module) in seen:  # named_modules lists a shared module once, where first met
                continue
            seen.add(id(module))
            node = parent.children.setdefault(key, _Node())
            tree._add(node, name)
            stack.extend(
                (child, node, k, f"{name}.{k}") for k, child in reversed(module._modules.items()) if child is not None
            )
        return tree

    def _add(self, node: _Node, name: str) -> None:
        node.order, node.name = len(self.names), name
        self.names.append(name)

    # "did you mean" costs a fuzzy comparison with every module shape; a plan of 100k rules
    # that all miss gets suggestions for the first ones only, and stays fast
    SUGGESTIONS = 50

    def suggest(self, pattern: str) -> list[str]:
        """Up to three module shapes close to a glob that matched nothing."""
        self._suggested += 1
        return closest(pattern, self.shapes, n=3) if self._suggested <= self.SUGGESTIONS else []

    @cached_property
    def shapes(self) -> list[str]:
        """The distinct generalized names (``model.layers.*.mlp``), for "did you mean"."""
        return sorted({generalize(n) for n in self.names})

    def match(self, pattern: str) -> tuple[str, ...]:
        """The module names ``pattern`` matches, in module order (a malformed glob matches
        nothing: check ``glob_problem`` first)."""
        if pattern == ROOT:  # the model itself, as torch's parallelize_module spells it
            return (ROOT,)
        segments = tuple(pattern.split("."))
        if "**" in segments:
            found: dict[int, str] = {}
            self._walk(self.root, segments, found, set())
            return tuple(found[k] for k in sorted(found))
        frontier = [self.root]
        for segment in segments:  # one level of the tree per segment
            if segment == "*":
                frontier = [c for node in frontier for c in node.children.values()]
            elif _WILDCARD.search(segment):
                frontier = [c for node in frontier for key, c in node.children.items() if fnmatchcase(key, segment)]
            else:
                frontier = [child for node in frontier if (child := node.children.get(segment)) is not None]
        return tuple(node.name for node in sorted(frontier, key=lambda n: n.order) if node.order >= 0)

    def _walk(self, node: _Node, rest: tuple[str, ...], found: dict[int, str], seen: set[tuple[int, int]]) -> None:
        # (node, remaining segments) pairs already explored: '**' reaches the same pair along
        # many paths, and without this a glob of many '**' segments would take exponential time
        key = (id(node), len(rest))
        if key in seen:
            return
        seen.add(key)
        if not rest:
            if node.order >= 0:
                found[node.order] = node.name
            return
        head, tail = rest[0], rest[1:]
        if head == "**":
            self._walk(node, tail, found, seen)  # zero segments
            for child in node.children.values():  # one or more
                self._walk(child, rest, found, seen)
        elif not _WILDCARD.search(head):
            named = node.children.get(head)
            if named is not None:
                self._walk(named, tail, found, seen)
        else:
            for segment, child in node.children.items():
                if fnmatchcase(segment, head):
                    self._walk(child, tail, found, seen)


def glob_matches(pattern: str, name: str) -> bool:
    """Whether ``pattern`` matches the one module name ``name``."""
    return bool(ModuleTree([name]).match(pattern))
