"""Answers budgeted like requests: their size as sent, one process's bytes in flight, and encoding off the loop.

Before a request runs, its answer's size is known from its rows and tokens: values per output
times the bytes each value takes as the front end will send it (`value_bytes`: 4 for a float32
and 1 for an int8 as raw bytes over gRPC or KServe binary data, up to 16 and 5 as JSON numbers,
4/3 of the raw bytes in base64). An answer over `--max-response-bytes` is refused (TooLarge: RESOURCE_EXHAUSTED, HTTP
413); an answer that would take the answers in flight past this process's share of
`--max-answer-bytes-in-flight` is refused for now (Overloaded: RESOURCE_EXHAUSTED, HTTP 429 with
Retry-After). Its bytes are held in the request's `Reservation` until its envelope closes, once the
transport has taken the answer: a client that reads slowly holds its share of the budget, not more.
"""

from __future__ import annotations

import numpy as np
import orjson

from service.errors import Overloaded, TooLarge, Unavailable
from service.ops import metrics

RAW = "raw"
"""Values as raw little-endian bytes (gRPC raw_output_contents, KServe binary data)."""
JSON = "json"
"""Values as JSON numbers."""
BASE64 = "base64"
"""Values' raw bytes in base64 (OpenAI's encoding_format=base64, Cohere's base64)."""
_RAW_BYTES = {"FP32": 4.0, "INT8": 1.0, "UINT8": 1.0, "INT64": 8.0}
_JSON_BYTES = {"FP32": 16.0, "INT8": 5.0, "UINT8": 4.0, "INT64": 21.0}
"""A value as a JSON number at most: a float32 in its shortest round-trip form (9 significant digits, sign,
exponent, comma); an int8 as "-128,"; a uint8 as "255,"; an int64 as its 20 characters and a comma (a sparse
term's index, which TEI's {"index", "value"} objects also fit in)."""


def value_bytes(encoding: str, datatype: str) -> float:
    """Bytes one value of a datatype (FP32, INT8, UINT8) takes as sent in an encoding (RAW, JSON or BASE64)."""
    if encoding == JSON:
        return _JSON_BYTES[datatype]
    raw = _RAW_BYTES[datatype]
    return raw * 4 / 3 if encoding == BASE64 else raw


INLINE_ENCODE_BYTES = 1024 * 1024
"""Answers up to this size are encoded on the event loop; larger ones on a worker thread."""
JSON_CHUNK_VALUES = 32 * 1024
"""Values written to JSON in one call: the worker thread holds the GIL for no more than one such call at a
time, so the event loop keeps answering while a large answer is written (docs/decisions.md#json-chunk-size)."""


class AnswerBudget:
    """The bytes of answers this process has accepted to send and not yet handed to the transport."""

    def __init__(self, max_response_bytes: int, max_in_flight_bytes: int) -> None:
        self.max_response_bytes = max_response_bytes
        self.max_in_flight_bytes = max_in_flight_bytes
        self.in_flight_bytes = 0

    def reserve(self, size: int) -> int:
        """Count an answer of `size` bytes (as sent) in flight, or refuse it (over its limit, or over the budget)."""
        if size > self.max_response_bytes:
            raise TooLarge(
                f"the requested outputs would take {size} bytes as sent, over the limit of {self.max_response_bytes}"
                " bytes per response (--max-response-bytes); request fewer rows, only the embedding, or binary"
                " outputs",
                "response_too_large",
            )
        # An answer alone may exceed the budget (it is within --max-response-bytes): it then waits for none.
        if self.in_flight_bytes + size > self.max_in_flight_bytes and self.in_flight_bytes:
            raise Overloaded(
                f"answers in flight hold {self.in_flight_bytes} bytes and this one needs {size} more, over the"
                f" {self.max_in_flight_bytes} bytes this process may hold (--max-answer-bytes-in-flight); retry later",
                "answer_budget",
            )
        self.in_flight_bytes += size
        metrics.ANSWER_BYTES.set(self.in_flight_bytes)
        return size

    def release(self, size: int) -> None:
        """An answer was handed to the transport (or failed): its bytes leave the budget."""
        self.in_flight_bytes -= size
        metrics.ANSWER_BYTES.set(self.in_flight_bytes)


class Reservation:
    """One request's answer in the budget: held once its size is known, released once when the request ends.

    The envelope (service.envelope) makes it with the request and releases it whatever the outcome;
    the pipeline holds it where the answer's size becomes known. A request answered by several pipeline
    calls (OpenAI's texts and images mixed: one call for each kind) holds each call's part in it.
    """

    __slots__ = ("_budget", "_released", "bytes")

    def __init__(self, budget: AnswerBudget) -> None:
        self._budget = budget
        self._released = False
        self.bytes = 0
        """The bytes held now (0 before `hold` and after `release`)."""

    def hold(self, size: int) -> int:
        """Count `size` more bytes of the answer in flight, or refuse them (AnswerBudget.reserve); returns `size`.

        A request that already ended (its client gone, the drain) holds nothing: Unavailable.
        """
        if self._released:
            raise Unavailable("the request ended before its answer was budgeted")
        self.bytes += self._budget.reserve(size)
        return size

    def release(self) -> None:
        """The request ended (answered, failed, or its client gone): its bytes leave the budget; once."""
        self._released = True
        if self.bytes:
            self._budget.release(self.bytes)
            self.bytes = 0


def json_values(values: np.ndarray) -> orjson.Fragment:
    """An array as one flat JSON array (row-major): float32 values each in its shortest exact form, or integers.

    Written JSON_CHUNK_VALUES at a time: between chunks other threads run, the event loop's among them.
    """
    dtype = values.dtype if values.dtype.kind in "iu" else np.float32
    flat = np.ascontiguousarray(values, dtype=dtype).ravel()
    chunks = [
        orjson.dumps(flat[start : start + JSON_CHUNK_VALUES], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
        for start in range(0, flat.size, JSON_CHUNK_VALUES)
    ]
    return orjson.Fragment(b"[" + b",".join(chunks) + b"]")
