"""`python -m mpdiag`: the command line (see mpdiag.cli); exits with the command's status."""

from mpdiag.cli import main
from mpdiag.sandbox.shutdown import exit_without_collecting

exit_without_collecting(main())
