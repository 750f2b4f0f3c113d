# syntax=docker/dockerfile:1
#
# encoder-serve image: the model repository is exported at build time (torch lives only in the
# `export` stage) and served by a runtime that installs the serving dependencies alone.
#
#   GPU (default): docker build -t encoder-serve:0.1.0-cuda13 .
#   CPU:           docker build --build-arg BASE=python:3.11-slim -t encoder-serve:0.1.0-cpu .
#   CPU, with the exporter (serves `--model org/name` or a raw folder, exported at start; torch's CPU build
#   beside the server): docker build --build-arg BASE=python:3.11-slim --build-arg VENV=server-export \
#                          -t encoder-serve:0.1.0-cpu-export .
#
# BASE is any glibc >= 2.28 image: the runtime brings its own interpreter (below), so the CUDA
# image does not need a Python 3.11 package of its own. onnxruntime-gpu 1.31 is built for CUDA 13.0
# and cuDNN 9; the host needs an NVIDIA driver >= 580 and the NVIDIA Container Toolkit.
ARG BASE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04
# The runtime's virtualenv: server (the serving dependencies alone) or server-export (and the exporter).
ARG VENV=server

# ---------------------------------------------------------------------------------------------
# Build stage: export the default model (all-MiniLM-L6-v2) into a model repository at /models.
FROM python:3.11-slim AS export

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src

# CPU-only torch from PyTorch's own index, installed first: torch 2.13.0 from PyPI is the CUDA build
# (several GB of CUDA libraries the exporter never uses). The `export` extra's pin (==2.13.0) is then
# already satisfied by 2.13.0+cpu, so the next step does not replace it.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY service/ service/
COPY export/ export/
COPY client/ client/
COPY protocol/ protocol/
RUN pip install "./[export]" \
    && python -m export --repository /models

# ---------------------------------------------------------------------------------------------
# Serving environment: a relocatable CPython 3.11 (python-build-standalone, via uv) in /opt/python
# and a virtualenv in /opt/venv with the serving dependencies only (no torch). Both are copied to
# the same paths in the runtime stage, whatever its base image. The uv pin fixes the 3.11 patch release.
FROM python:3.11-slim AS venv

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_NO_CACHE=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_MANAGED_PYTHON=1

RUN pip install uv==0.13.9 \
    && uv python install 3.11 \
    && uv venv /opt/venv --python 3.11

WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
COPY export/ export/
COPY client/ client/
COPY protocol/ protocol/
# A regular (non-editable) install: the runtime stage copies the venv, not the sources.
RUN uv pip install --python /opt/venv/bin/python ".[server]"

FROM venv AS venv-server

# The exporter beside the server, for models served by name: torch's CPU build from PyTorch's own index
# first (as in the export stage), which the `export` extra's pin (==2.13.0) then accepts.
FROM venv AS venv-server-export
RUN uv pip install --python /opt/venv/bin/python torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && uv pip install --python /opt/venv/bin/python ".[server,export]"

# One of the two stages above, by name (hadolint takes a name built from an ARG for an untagged image).
# hadolint ignore=DL3006
FROM venv-${VENV} AS venv-chosen

# ---------------------------------------------------------------------------------------------
# Runtime.
FROM ${BASE} AS runtime

# ENCODER_HEALTH_PORT: probes (kubelet's, the HEALTHCHECK below) get a plaintext grpc.health.v1
# listener of their own, which never queues behind inference calls and needs no TLS.
# ORT_DISABLE_TELEMETRY: ONNX Runtime (1.29+ on Linux) otherwise starts its remote telemetry at import
# and writes a device ID and an event store under $HOME/.cache, which is read-only here (it warns, then
# keeps the ID in memory); a server in someone's cluster sends nothing to anyone.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ORT_DISABLE_TELEMETRY=1 \
    ENCODER_HEALTH_PORT=8003

COPY --from=venv /opt/python /opt/python
COPY --from=venv-chosen /opt/venv /opt/venv
# Owned by root and read-only for the server: the pod runs with a read-only root filesystem.
COPY --from=export /models /models

# A fixed numeric UID/GID (not 1000, which Ubuntu images already give to `ubuntu`), so that
# Kubernetes' runAsNonRoot can verify it; --no-log-init keeps a high UID from bloating /var/log/lastlog.
RUN groupadd --system --gid 10001 encoder \
    && useradd --system --no-log-init --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin encoder
USER 10001:10001

# HTTP (OpenAI API, KServe v2 REST), gRPC, metrics, and the plaintext health listener (8003).
EXPOSE 8000 8001 8002 8003

# Model loading and warm-up happen before the health service reports SERVING.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "service.ops.healthcheck"]

ENTRYPOINT ["python", "-m", "service"]
CMD ["--model-repository", "/models"]
