"""`python -m tools.deadline_race`: calls that expire and calls that do not, on one gRPC channel; outcomes counted.

Several threads send calls with short deadlines (each expires while it waits for its batch, and the
client resets its stream as the server answers DEADLINE_EXCEEDED), one thread sends calls with a
patient deadline; all share one channel, so one HTTP/2 connection. A connection the server fails
fails the patient calls on it too (UNAVAILABLE). Printed as JSON: the outcome counts of each kind
of call. Exit status 0 when every patient call was answered OK, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

import grpc

from client.protocol import text_request
from protocol import grpc_service_pb2_grpc as pb_grpc

SHORT_DEADLINE_S = 0.02
PATIENT_DEADLINE_S = 10.0


@dataclass
class Outcomes:
    """Outcome counts by kind of call ("short", "patient"), safe to add to from several threads."""

    counts: dict[str, Counter[str]] = field(default_factory=lambda: {"short": Counter(), "patient": Counter()})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str) -> None:
        """Count one call's outcome."""
        with self.lock:
            self.counts[kind][outcome] += 1


def _outcome(call: grpc.UnaryUnaryMultiCallable, request: object, deadline_s: float) -> str:
    try:
        call(request, timeout=deadline_s)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return error.code().name
        return f"{error.code().name} {error.details()}"
    return "OK"


def race(target: str, model: str, patient_calls: int, short_threads: int = 4) -> Outcomes:
    """Send `patient_calls` patient calls while `short_threads` threads send calls that expire, on one channel."""
    outcomes, stop = Outcomes(), threading.Event()
    request = text_request(model, ["one text"])
    with grpc.insecure_channel(target) as channel:
        model_infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer

        def short() -> None:
            while not stop.is_set():
                outcomes.add("short", _outcome(model_infer, request, SHORT_DEADLINE_S))

        threads = [threading.Thread(target=short) for _ in range(short_threads)]
        for thread in threads:
            thread.start()
        try:
            for _ in range(patient_calls):
                outcomes.add("patient", _outcome(model_infer, request, PATIENT_DEADLINE_S))
        finally:
            stop.set()
            for thread in threads:
                thread.join()
    return outcomes


def main() -> int:
    """Run the race against a server and print the outcomes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="127.0.0.1:8001", help="the server's gRPC address")
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--patient-calls", type=int, default=400, help="patient calls to send (one at a time)")
    parser.add_argument("--short-threads", type=int, default=4, help="threads sending calls with 20 ms deadlines")
    arguments = parser.parse_args()
    outcomes = race(arguments.target, arguments.model, arguments.patient_calls, arguments.short_threads)
    print(json.dumps({kind: dict(counts) for kind, counts in outcomes.counts.items()}, indent=1))
    return 0 if set(outcomes.counts["patient"]) <= {"OK"} else 1


if __name__ == "__main__":
    sys.exit(main())
