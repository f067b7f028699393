import sys

from mithrilfs.cli.commands import main

sys.exit(main())
