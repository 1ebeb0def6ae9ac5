"""The ``plancc`` command line: one module per command, each a thin parse -> call -> print over
the API; the option groups (``options``) and the app, its formats and exit codes (``app``)
declared once. Importing it loads neither torch nor transformers: each command imports what it
runs when it runs (``plancc --help`` stays fast; ``tests/test_startup.py``).

Exit codes: 0 ok (warnings allowed), 1 plan/config problems, 2 usage errors.
"""

from __future__ import annotations

import signal
import sys

# every command module registers its command on ``app`` as it is imported
from . import (  # noqa: F401
    explain_command,
    import_hf_command,
    models_command,
    plot_command,
    rules_command,
    styles_command,
    suggest_command,
    validate_command,
)
from .app import EXIT_PLAN, EXIT_USAGE, Format, app
from .apply_command import apply
from .launching import Interrupted, interrupt
from .logprobs_command import logprobs

__all__ = ["EXIT_PLAN", "EXIT_USAGE", "Format", "app", "apply", "logprobs", "main"]

# `plancc --help` lists the commands in the order a user meets them, not the modules' import order
ORDER = ("validate", "explain", "suggest", "plot", "import-hf", "styles", "rules", "models", "apply", "logprobs")
app.registered_commands.sort(key=lambda c: ORDER.index(c.name or (c.callback.__name__ if c.callback else "")))


def main() -> None:  # console-script entry point
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    try:
        app()
    except Interrupted as stop:  # nothing was launched yet: nothing to stop or report but the fact
        print("interrupted before any worker started", file=sys.stderr)
        sys.exit(128 + stop.signum)
    finally:
        # The command is done: what it built (a meta model of 80 layers for suggest or validate)
        # is left to the interpreter's exit, whose collector would walk it again for over a second.
        # Frozen, it is not walked; atexit handlers and module teardown still run.
        import gc

        gc.freeze()
