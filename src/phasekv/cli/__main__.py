"""`python -m phasekv.cli ...` (what torchrun runs): the same as the `phasekv` command."""

import sys

from phasekv.cli import main

sys.exit(main())
