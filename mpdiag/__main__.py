import sys

from mpdiag.cli import main

sys.exit(main())
