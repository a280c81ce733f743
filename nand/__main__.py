import sys

from nand.cli import main

sys.exit(main())
