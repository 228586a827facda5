import sys

from moefuse.cli import main

sys.exit(main())
