import sys

from kvgraft.cli import main

sys.exit(main())
