"""``python -m hvd_compress.tools.bench.gpu_check``: see the package docstring."""
import sys

from .driver import main

if __name__ == "__main__":  # importing this module (pdoc does) runs nothing
    sys.exit(main())
