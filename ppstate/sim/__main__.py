"""``python -m ppstate.sim``: run the simulator from the command line (:mod:`ppstate.sim.cli`)."""

import sys

from ppstate.cli_pipe import run_main
from ppstate.sim.cli import run_cli

if __name__ == "__main__":
    sys.exit(run_main(run_cli))
