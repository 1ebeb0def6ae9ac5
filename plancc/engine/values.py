"""Options given as one frozen value or as its fields' keywords (``Microbatching``,
``WeightFormat``): the one rule for both."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

Value = TypeVar("Value")


def given_or_keywords(cls: type[Value], given: Value | None, keywords: Mapping[str, Any], argument: str) -> Value:
    """``given``, or the ``cls`` its fields as keywords spell; both at once, or a keyword that is
    no field, is a ``TypeError`` (as a misspelt keyword is for any function)."""
    fields = sorted(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    unknown = sorted(set(keywords) - set(fields))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (a {cls.__name__}'s are {', '.join(fields)})")
    if given is not None and keywords:
        raise TypeError(f"give {argument}= or its keywords ({', '.join(f + '=' for f in fields)}), not both")
    return given if given is not None else cls(**keywords)
