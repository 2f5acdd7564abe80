import sys

from tclightning.cli.main import main

sys.exit(main())
