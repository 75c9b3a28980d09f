"""``python -m hvd_compress.kernels``: build the fused kernels now (install time):
the C library (torch, ctypes) and, where TensorFlow is installed, its op library."""
import importlib.util

from .native import build

if __name__ == "__main__":
    print(build())
    if importlib.util.find_spec("tensorflow") is not None:
        from .tf_native import build as build_tf
        print(build_tf())
