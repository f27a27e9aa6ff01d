"""``python -m phasegraph.cli``: the ``phasegraph`` command."""

import sys

from phasegraph.cli import main

sys.exit(main())
