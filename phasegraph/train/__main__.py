"""``python -m phasegraph.train``: the training command, :mod:`phasegraph.cli.train`."""

import sys

from phasegraph.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
