"""``python -m phasegraph``: the ``phasegraph`` command (``torchrun -m phasegraph ...`` runs it on
every rank)."""

import sys

from phasegraph.cli import main

sys.exit(main())
