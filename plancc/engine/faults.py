"""Fault injection moved to ``plancc.runtime.faults`` (the runtime's own file work -- an export --
has fault points too); its names stay importable from here."""

from ..runtime.faults import inject, poisoned

__all__ = ["inject", "poisoned"]
