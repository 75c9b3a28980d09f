# The two commands README.md documents:
#   make demo  -- set everything up, then train on real MNIST digits with 2 processes and a compressor
#   make test  -- set everything up, then run the whole test suite
#   PYTHON=python3.12 make test -- the same on Python 3.12 or 3.13, in its own .venv-py312 / .venv-py313
.PHONY: setup demo test docs clean-cache
PY := .venv/bin/python

setup:
	bash scripts/install.sh

demo: setup
	bash scripts/demo.sh

test: setup
	bash scripts/run_tests.sh

docs: setup
	bash scripts/build_docs.sh

clean-cache:
	rm -rf $${HVD_COMPRESS_CACHE:-$$HOME/.cache/hvd_compress}
