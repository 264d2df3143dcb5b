"""`python -m mpdiag`: the command line (see mpdiag.cli); exits with the command's status."""

import sys

from mpdiag.cli import main

sys.exit(main())
