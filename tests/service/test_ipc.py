"""The engine's wire without processes: answers stacked by shape come back to each request as they left."""

from __future__ import annotations

import numpy as np

from service.core import wire as ipc
from service.core.rows import WorkResult
from service.errors import Overloaded


def _result(seed: int, shapes: dict[str, tuple[int, ...]]) -> WorkResult:
    rng = np.random.default_rng(seed)
    outputs = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    return WorkResult(outputs, queue_s=seed / 1000, compute_s=seed / 100, batch_rows=seed)


def test_answers_of_mixed_shapes_travel_stacked_and_come_back_to_their_requests() -> None:
    answers = [
        (11, _result(1, {"embedding": (1, 4)})),
        (12, _result(2, {"embedding": (3, 4), "last_hidden_state": (3, 5, 4)})),
        (13, _result(3, {"embedding": (1, 4)})),
        (14, _result(4, {"embedding": (3, 4), "last_hidden_state": (3, 5, 4)})),
        (15, _result(5, {"embedding": (1, 4)})),
    ]
    messages = ipc.answer_messages(answers)
    assert [message.ids for message, _ in messages] == [[11, 13, 15], [12, 14]]
    assert [len(stacked) for _, stacked in messages] == [1, 2]
    header = ipc.encode([message for message, _ in messages])
    payload = b"".join(array.tobytes() for _, stacked in messages for array in stacked)

    received, offset = {}, 0
    for message in ipc.decode_to_frontend(header):
        results, offset = ipc.answered(message, payload, offset)
        received.update(zip(message.ids, results, strict=True))
    assert offset == len(payload)
    assert sorted(received) == [11, 12, 13, 14, 15]
    for request_id, sent in answers:
        got = received[request_id]
        assert (got.queue_s, got.compute_s, got.batch_rows) == (sent.queue_s, sent.compute_s, sent.batch_rows)
        assert got.outputs.keys() == sent.outputs.keys()
        for name, array in sent.outputs.items():
            np.testing.assert_array_equal(got.outputs[name], array)


def test_a_failure_travels_as_its_typed_error() -> None:
    header = ipc.encode([ipc.Failed(7, ipc.failure_of(Overloaded("queue full", "queue_full")))])
    (message,) = ipc.decode_to_frontend(header)
    error = ipc.error_of(message.failure)
    assert (message.id, type(error), str(error), error.reason) == (7, Overloaded, "queue full", "queue_full")
