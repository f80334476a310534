# The two commands a newcomer needs: `make demo` and `make test` (README.md).
PY := .venv/bin/python

.PHONY: setup demo test lint gpu-test

setup:
	bash scripts/bootstrap.sh

demo: setup
	$(PY) -P -m hybridcache.services.cli demo --serve

test: setup
	$(PY) -m ruff check .
	$(PY) -P -m pytest -q

lint: setup
	$(PY) -m ruff check .

# Run on a machine with a CUDA GPU (the device machine); CI never runs these.
gpu-test:
	$(PY) -P -m pytest -q -m gpu
