import sys

from .command.cli import main

sys.exit(main())
