"""``python -m phasegraph``: the ``phasegraph`` command (``torchrun -m phasegraph ...`` runs it on
every rank)."""

import sys

from phasegraph.cli import main

if __name__ == "__main__":  # not in a spawned child process, which imports this module again
    sys.exit(main())
