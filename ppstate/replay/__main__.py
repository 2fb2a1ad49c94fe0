"""``python -m ppstate.replay``: see :mod:`ppstate.replay.cli`."""

import sys

from ppstate.cli_pipe import run_main
from ppstate.replay.cli import main

sys.exit(run_main(main))
