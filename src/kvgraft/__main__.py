import sys

from kvgraft.cli import run

sys.exit(run())
