"""`python -m jacobi_ext ...` is the `jacobi-forcing` command."""

import sys

from .apps.cli import main

sys.exit(main())
