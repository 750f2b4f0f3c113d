# One entry point for people and CI. `make serve` and `make test` work on a fresh machine.
VENV        ?= .venv
PYTHON      ?= python3
PY          := $(VENV)/bin/python
REPOSITORY  ?= model_repository
MODEL       ?= all-MiniLM-L6-v2
MODEL_FILE  := $(REPOSITORY)/$(MODEL)/config.pbtxt

.PHONY: setup system-packages serve export test lint protos bench loadtest perf-analyzer stress gpu-check clean

# torch is pinned to the CPU wheel (2.13.0) in the export extra: any other version pulls a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[server,export,tools,test]'
	touch $@

# Debian packages (need root): prometheus (promtool and a server) for the monitoring tests,
# libb64-0d, which perf_analyzer links, and nghttp2-client (h2load, the capacity and served benches' client).
system-packages:
	@missing=""; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	dpkg -s libb64-0d >/dev/null 2>&1 || missing="$$missing libb64-0d"; \
	command -v h2load >/dev/null 2>&1 || missing="$$missing nghttp2-client"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
		else echo "install Debian's$$missing packages: promtool for the monitoring tests, libb64 for perf_analyzer, h2load for the benches" >&2; fi; \
	fi

setup: $(VENV)/.installed system-packages

$(MODEL_FILE): | $(VENV)/.installed
	$(PY) -m export --repository $(REPOSITORY)

export: $(VENV)/.installed
	$(PY) -m export --repository $(REPOSITORY)

SERVE_FLAGS ?=
# MODEL=org/name[@REVISION] (or a folder: a path with a /) is served by its name: exported at start behind the
# parity gate into the export cache (~/.cache/encoder-serve), once; a plain name is served from $(REPOSITORY).
ifneq ($(findstring /,$(MODEL)),)
serve: $(VENV)/.installed
	$(PY) -m service --model $(MODEL) --health-port 8003 $(SERVE_FLAGS)
else
serve: $(VENV)/.installed $(MODEL_FILE)
	$(PY) -m service --model-repository $(REPOSITORY) --health-port 8003 $(SERVE_FLAGS)
endif

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) protos/generate.py --check

# The venv's tools (kubectl, hadolint, perf_analyzer) come first on PATH. ENCODER_TEST_REQUIRE_TOOLS=1:
# a test whose external program (promtool, prometheus, kubectl, locust) is missing fails instead of
# skipping, so the suite cannot shrink quietly (make setup installs them). The end-to-end suites then
# run again against servers of two front-end processes and an engine process (ENCODER_FRONTENDS=2),
# with the clients we did not write; and every suite that calls the gRPC port runs again with that
# port on grpcio (ENCODER_GRPC_TRANSPORT=grpcio: the main pass serves it on Envoy, auto's choice here).
# Every suite listed serves through the front ends, or calls the gRPC port, whose process layout the two
# settings change (grpcio with one front end is a single process; Envoy or two front ends, a supervisor and
# children), so none is dropped. The passes share the exported test models: the first pass writes each
# into .test-cache/exports/ (keyed by its inputs and the exporter's sources: tests/export_cache.py) and the
# later passes reuse it, as they reuse the default model's export (TEST_REPOSITORY); `rm -rf .test-cache`
# makes each run export them afresh.
MULTIPROCESS_SUITES := $(addprefix tests/service/,test_grpc.py test_streaming.py test_http_openai.py \
	test_http_kserve.py test_http_security.py test_http_lifecycle.py test_security.py test_shutdown.py \
	test_cancellation.py test_limits.py test_readiness.py test_statistics.py test_metrics.py test_row_batching.py \
	test_watchdog.py test_embedding_types.py test_long_texts.py test_sparse.py test_multivector.py test_task_grpc.py \
	test_priorities.py test_fair_share.py test_connection_age.py test_image_serving.py test_image_scores.py)
GRPC_SUITES := $(MULTIPROCESS_SUITES) tests/client tests/tools/test_perf_analyzer.py tests/tools/test_stress_phases.py \
	tests/tools/test_locustfile.py tests/test_healthcheck.py tests/deploy/test_kserve.py $(addprefix tests/service/,test_answers.py \
	test_fuzz.py test_tenants.py test_tracing.py test_prometheus.py test_tasks.py test_processes.py)
TEST_REPOSITORY := $(abspath .test-cache/default-repository)
test: setup lint
	rm -rf .test-cache
	PATH="$(abspath $(VENV))/bin:$$PATH" ENCODER_TEST_DEFAULT_REPOSITORY=$(TEST_REPOSITORY) ENCODER_TEST_REQUIRE_TOOLS=1 \
		$(PY) -m pytest --durations=25
	PATH="$(abspath $(VENV))/bin:$$PATH" ENCODER_TEST_DEFAULT_REPOSITORY=$(TEST_REPOSITORY) ENCODER_TEST_REQUIRE_TOOLS=1 \
		ENCODER_FRONTENDS=2 $(PY) -m pytest --durations=10 $(MULTIPROCESS_SUITES)
	PATH="$(abspath $(VENV))/bin:$$PATH" ENCODER_TEST_DEFAULT_REPOSITORY=$(TEST_REPOSITORY) ENCODER_TEST_REQUIRE_TOOLS=1 \
		ENCODER_GRPC_TRANSPORT=grpcio $(PY) -m pytest --durations=10 $(GRPC_SUITES)

protos: $(VENV)/.installed
	$(PY) protos/generate.py

# The GPU test plan (tests marked gpu; skipped, and reported so, where CUDA is unusable): the
# environment and every test's outcome go to gpu-report/ (report.txt, junit.xml, environment.txt).
gpu-check: $(VENV)/.installed
	@mkdir -p gpu-report
	@{ nvidia-smi 2>&1 || echo "nvidia-smi: not available"; \
	  $(PY) -c "import onnxruntime as o; from service.core.runtime import cuda_unavailable_reason as r; \
	print('onnxruntime', o.__version__, o.get_available_providers()); print('CUDA:', r() or 'usable')"; \
	} > gpu-report/environment.txt 2>&1
	@cat gpu-report/environment.txt
	$(PY) -m pytest -m gpu -v -rs --junitxml=gpu-report/junit.xml > gpu-report/report.txt 2>&1; \
	status=$$?; cat gpu-report/report.txt; echo "GPU report: gpu-report/report.txt"; exit $$status

bench: $(VENV)/.installed $(MODEL_FILE)
	$(PY) -m export.bench --repository $(REPOSITORY) --output bench-results/export.json

# Drive a running server (make serve in another shell): closed-loop sweep, report in loadtest-results/.
loadtest: $(VENV)/.installed
	$(PY) -m tools.loadtest --target 127.0.0.1:8001 --concurrency 1,8,32,64 --duration-s 20

# Triton's perf_analyzer against a running server (make serve in another shell): token ids, texts and
# texts over --streaming on gRPC, token ids and texts over HTTP, at each concurrency; figures on
# stdout, CSVs in perf-results/.
perf-analyzer: $(VENV)/.installed system-packages $(MODEL_FILE)
	$(PY) -m tools.perf_analyzer --target 127.0.0.1:8001 --http-target 127.0.0.1:8000 --model $(MODEL) --repository $(REPOSITORY) \
		--concurrency 1,8,32 --output-dir perf-results

# Hostile phases against a running server (make serve in another shell); report in bench-results/stress/.
stress: $(VENV)/.installed
	$(PY) -m tools.stress --target 127.0.0.1:8001 --http-target 127.0.0.1:8000 --health-target 127.0.0.1:8003 \
		--metrics-url http://127.0.0.1:8002/metrics --output bench-results/stress

clean:
	rm -rf $(VENV) $(REPOSITORY) bench-results loadtest-results perf-results gpu-report .pytest_cache .ruff_cache .test-cache
