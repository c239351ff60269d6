"""`python -m decodelab ...` is the `decodelab` console script."""
import sys

from decodelab.cli import main

sys.exit(main())
