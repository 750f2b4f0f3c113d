"""Locust users that embed texts from the shipped corpus through `client.EmbeddingClient`.

    locust -f deploy/loadtest/locustfile.py --host 127.0.0.1:8001 [--model NAME] [--batch-size 1]
           [--mix short=0.8,long=0.2] [--timeout-s 10]

`--host` is a gRPC target (HOST:PORT or dns:///NAME:PORT). TLS, mutual TLS and the API key come
from the ENCODER_CLIENT_* variables as for every client here (ENCODER_CLIENT_TLS_CA,
ENCODER_CLIENT_API_KEY_FILE, ...): Locust's own --tls-cert and --tls-key are its web UI's. The
project must be importable
(`pip install -e .`, or run from the repository root with `PYTHONPATH=.`). Each call is reported to
Locust as a `grpc` request named after its corpus, with the response time, the embedding bytes, and
the EmbeddingError when the server refused or failed it.
"""

from __future__ import annotations

import random
import time

import grpc.experimental.gevent as grpc_gevent
from locust import User, constant, events, task
from locust.argument_parser import LocustArgumentParser

from client import DEFAULT_MODEL, EmbeddingClient, EmbeddingError
from protocol.channel_security import security_from_env
from tools.loadtest.config import parse_mix
from tools.loadtest.corpus import load_corpus

# gRPC's blocking calls must yield to Locust's gevent loop, or one user would stall all the others.
grpc_gevent.init_gevent()


@events.init_command_line_parser.add_listener
def add_arguments(parser: LocustArgumentParser) -> None:
    """The model, request size and mix, as Locust command-line options."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name")
    parser.add_argument("--batch-size", type=int, default=1, help="texts per request")
    parser.add_argument("--mix", default="short=1", help="request kinds, e.g. short=0.8,long=0.2")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="deadline per request")


class EmbeddingUser(User):
    """Sends one embedding request after another, each of batch-size texts of a kind drawn from the mix."""

    wait_time = constant(0)

    def on_start(self) -> None:
        """Open the client (transport security from the environment) and read the options."""
        options = self.environment.parsed_options
        mix = parse_mix(options.mix)
        self.kinds = list(mix)
        self.weights = [mix[kind] for kind in self.kinds]
        self.batch_size = options.batch_size
        self.random = random.Random()
        self.client = EmbeddingClient(
            self.host,
            model=options.model,
            timeout_s=options.timeout_s,
            batch_size=options.batch_size,
            security=security_from_env(),
        )

    def on_stop(self) -> None:
        """Close the client's channel."""
        self.client.close()

    @task
    def embed(self) -> None:
        """One ModelInfer call, reported to Locust."""
        kind = self.random.choices(self.kinds, self.weights)[0]
        texts = self.random.choices(load_corpus(kind), k=self.batch_size)
        started = time.perf_counter()
        response_length = 0
        exception: EmbeddingError | None = None
        try:
            response_length = self.client.embed(texts).nbytes
        except EmbeddingError as error:
            exception = error
        self.environment.events.request.fire(
            request_type="grpc",
            name=f"ModelInfer {kind}",
            response_time=(time.perf_counter() - started) * 1000,
            response_length=response_length,
            exception=exception,
            context={},
        )
