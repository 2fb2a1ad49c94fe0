"""``python -m ppstate.replay``: see :mod:`ppstate.replay.cli`."""

import sys

from ppstate.replay.cli import main

sys.exit(main())
