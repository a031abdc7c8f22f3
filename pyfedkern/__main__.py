"""``python -m pyfedkern``: the ``pyfedkern`` command line."""

import sys

from pyfedkern.cli import main

sys.exit(main())
