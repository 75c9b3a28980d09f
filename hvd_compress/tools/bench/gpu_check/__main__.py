"""``python -m hvd_compress.tools.bench.gpu_check``: see the package docstring."""
import sys

from .driver import main

sys.exit(main())
