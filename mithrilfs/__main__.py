import sys

from mithrilfs.cli.main import main

sys.exit(main())
