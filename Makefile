# One entry point for people and CI. `make serve` and `make test` work on a fresh machine.
VENV        ?= .venv
PYTHON      ?= python3
PY          := $(VENV)/bin/python
REPOSITORY  ?= model_repository
MODEL       ?= all-MiniLM-L6-v2
MODEL_FILE  := $(REPOSITORY)/$(MODEL)/config.pbtxt

.PHONY: setup system-packages serve export test lint protos bench loadtest clean

# torch is pinned to the CPU wheel (2.13.0) in the export extra: any other version pulls a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[export,client,test]'
	touch $@

# promtool and a Prometheus server, for the monitoring tests (Debian package; needs root).
system-packages:
	@command -v promtool >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
		else echo "install Debian's prometheus package (promtool) for the monitoring tests" >&2; fi; }

setup: $(VENV)/.installed system-packages

$(MODEL_FILE): | $(VENV)/.installed
	$(PY) -m export --repository $(REPOSITORY)

export: $(VENV)/.installed
	$(PY) -m export --repository $(REPOSITORY)

SERVE_FLAGS ?=
serve: $(VENV)/.installed $(MODEL_FILE)
	$(PY) -m service --model-repository $(REPOSITORY) $(SERVE_FLAGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) protos/generate.py --check

test: setup lint
	$(PY) -m pytest

protos: $(VENV)/.installed
	$(PY) protos/generate.py

bench: $(VENV)/.installed $(MODEL_FILE)
	$(PY) -m export.bench --repository $(REPOSITORY) --output bench-results/export.json

# Drive a running server (make serve in another shell): closed-loop sweep, report in loadtest-results/.
loadtest: $(VENV)/.installed
	$(PY) -m client.loadtest --target 127.0.0.1:8001 --concurrency 1,8,32,64 --duration-s 20

clean:
	rm -rf $(VENV) $(REPOSITORY) bench-results loadtest-results .pytest_cache .ruff_cache
