"""``python -m hvd_compress.kernels``: build the fused kernels now (install time)."""
from .native import build

if __name__ == "__main__":
    print(build())
