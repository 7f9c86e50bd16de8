"""`python -m omnickpt.cli ...` runs the command line."""
import sys

from omnickpt.cli import main

sys.exit(main())
