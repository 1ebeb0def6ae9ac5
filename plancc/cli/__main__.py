"""``python -m plancc.cli``: the ``plancc`` command."""

from . import main

main()
