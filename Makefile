# The two commands the README starts with:
#   make demo   set up .venv/ and run a 3-rank training job that survives injected failures
#   make test   set up .venv/ (with dev tools) and run the test suite
# CI (.ci/run) also runs make test-bench (the benchmark scripts' smoke runs) and make lint.
.PHONY: demo test test-quick test-bench lint bench clean

demo:
	scripts/setup.sh
	.venv/bin/nonstop demo --nproc 3 --spares 1 --steps 60 \
	  --fail kill:rank=1,step=15 --fail hang:rank=2,step=30 --fail exit:rank=0,step=45,code=3 \
	  --verify --json .nonstop/demo/report.json

test:
	scripts/setup.sh dev
	.venv/bin/python -m pytest -q -m "not bench"

test-quick:
	.venv/bin/python -m pytest -q -m "not slow and not bench"

test-bench:
	.venv/bin/python -m pytest -q -m bench

lint:
	.venv/bin/ruff check nonstop tests benchmarks
	.venv/bin/ruff format --check nonstop tests benchmarks
	.venv/bin/mypy

clean:
	rm -rf .nonstop .pytest_cache .mypy_cache .ruff_cache
	.venv/bin/nonstop gc || true
