"""`python -m phasekv ...`: the same as the `phasekv` command (and as `python -m phasekv.cli`)."""

import sys

from phasekv.cli import main

sys.exit(main())
