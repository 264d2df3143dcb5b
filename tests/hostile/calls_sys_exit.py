# check: the script called sys.exit(3)
# run: the script called sys.exit(3)
import sys


def build(device):
    sys.exit(3)
