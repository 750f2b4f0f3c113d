"""How a front end should talk to the engine process: CPU per request of each transport, measured here.

    python -m tools.ipc_bench [--seconds 4] [--callers 16]

A stand-in engine (a child process) answers each one-row request at once with a 384-float
embedding; 16 callers in this process keep one request each in flight. Each side's CPU time (as
the kernel counts it) per request, for:

- `service.core.wire` (the server's): length-prefixed frames of msgspec headers and raw arrays over a
  Unix socket, one frame per event-loop turn;
- pyzmq DEALER/ROUTER over ipc://, with the same messages built and read the same way: one
  message per turn (coalesced) and one per request (when pyzmq is installed: it is in the
  `client` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import uvloop

from service.core import wire as ipc
from service.core.rows import TokenRows, WorkResult
from service.core.wire import EngineLink, EngineServer, Submit
from tools.local_server import process_cpu_seconds

EMBEDDING = np.ones((1, 384), dtype=np.float32)
ROWS = TokenRows(np.arange(12, dtype=np.int64), np.array([12], dtype=np.int64), 12)
READY_TIMEOUT_S = 10


def _ours_engine(path: str) -> None:
    async def main() -> None:
        def answer(connection: ipc.EngineConnection, message: Submit, rows: TokenRows) -> None:
            connection.answer(message.id, WorkResult({"embedding": EMBEDDING}, 0.0, 0.0, 1))

        server = EngineServer(answer, lambda connection, request_id: None, lambda connection: None, lambda: None)
        await server.start(path)
        await asyncio.Event().wait()

    uvloop.run(main())


def _zmq_engine(path: str) -> None:
    import zmq  # noqa: PLC0415 - optional
    import zmq.asyncio  # noqa: PLC0415

    async def main() -> None:
        socket = zmq.asyncio.Context().socket(zmq.ROUTER)
        socket.bind(f"ipc://{path}")
        while True:
            identity, header, payload = await socket.recv_multipart()
            answers, offset = [], 0
            words = np.frombuffer(payload, np.int64)
            for submit in ipc.decode_to_engine(header):
                _, offset = ipc.rows_of(submit, words, offset)
                answers.append((submit.id, WorkResult({"embedding": EMBEDDING}, 0.0, 0.0, 1)))
            messages = ipc.answer_messages(answers)
            buffers = [array for _, arrays in messages for array in arrays]
            await socket.send_multipart([identity, ipc.encode([message for message, _ in messages]), b"".join(buffers)])

    uvloop.run(main())


async def _drive_ours(path: str, callers: int, seconds: float) -> int:
    link = await EngineLink.connect(path, 1, lambda update: None, lambda: None)

    async def call() -> None:
        _, future = link.submit("m", "", ROWS, ("embedding",), None)
        await future

    return await _closed_loop(call, callers, seconds)


async def _drive_zmq(path: str, callers: int, seconds: float, coalesce: bool) -> int:
    import zmq  # noqa: PLC0415 - optional
    import zmq.asyncio  # noqa: PLC0415

    socket = zmq.asyncio.Context().socket(zmq.DEALER)
    socket.connect(f"ipc://{path}")
    loop = asyncio.get_running_loop()
    pending: dict[int, asyncio.Future[WorkResult]] = {}
    outbox: list[tuple[Submit, list[memoryview]]] = []
    next_id = 0

    def flush() -> None:
        batch = list(outbox)
        outbox.clear()
        for group in [batch] if coalesce else [[one] for one in batch]:
            buffers = [buffer for _, arrays in group for buffer in arrays]
            socket.send_multipart([ipc.encode([message for message, _ in group]), b"".join(buffers)])

    async def reader() -> None:
        while True:
            header, payload = await socket.recv_multipart()
            offset = 0
            for message in ipc.decode_to_frontend(header):
                results, offset = ipc.answered(message, payload, offset)
                for request_id, result in zip(message.ids, results, strict=True):
                    pending.pop(request_id).set_result(result)

    async def call() -> None:
        nonlocal next_id
        next_id += 1
        future = pending[next_id] = loop.create_future()
        if not outbox:
            loop.call_soon(flush)
        outbox.append(ipc.submit_message(next_id, "m", "", ROWS, ("embedding",), deadline=None))
        await future

    reading = asyncio.ensure_future(reader())
    try:
        return await _closed_loop(call, callers, seconds)
    finally:
        reading.cancel()


async def _closed_loop(call: object, callers: int, seconds: float) -> int:
    for _ in range(100):
        await call()
    done = 0
    until = time.monotonic() + seconds

    async def caller() -> None:
        nonlocal done
        while time.monotonic() < until:
            await call()
            done += 1

    await asyncio.gather(*(caller() for _ in range(callers)))
    return done


def measure(transport: str, callers: int, seconds: float) -> tuple[float, float, float]:
    """Requests/s, and the front end's and the engine's CPU microseconds per request."""
    with tempfile.TemporaryDirectory() as scratch:
        path = str(Path(scratch) / "engine.sock")
        engine = subprocess.Popen([sys.executable, "-m", "tools.ipc_bench", "--engine", transport, path])
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not Path(path).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            started, engine_before, mine_before = time.monotonic(), process_cpu_seconds(engine.pid), time.process_time()
            if transport == "service.core.wire":
                done = uvloop.run(_drive_ours(path, callers, seconds))
            else:
                done = uvloop.run(_drive_zmq(path, callers, seconds, coalesce=transport == "pyzmq, coalesced"))
            elapsed = time.monotonic() - started
            engine_cpu = process_cpu_seconds(engine.pid) - engine_before
            mine = time.process_time() - mine_before
        finally:
            engine.kill()
            engine.wait()
    return done / elapsed, mine / done * 1e6, engine_cpu / done * 1e6


def main(argv: list[str] | None = None) -> int:
    """Measure each transport and print its figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.ipc_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--engine", nargs=2, metavar=("TRANSPORT", "PATH"), help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.engine:
        transport, path = arguments.engine
        (_ours_engine if transport == "service.core.wire" else _zmq_engine)(path)
        return 0
    transports = ["service.core.wire"]
    try:
        import zmq  # noqa: F401, PLC0415 - is it installed?

        transports += ["pyzmq, coalesced", "pyzmq, one message per request"]
    except ImportError:
        print("pyzmq is not installed: measuring service.core.wire only", file=sys.stderr)
    print(f"{'transport':<32} {'req/s':>8} {'front end us/req':>17} {'engine us/req':>14}")
    for transport in transports:
        rate, front_end, engine = measure(transport, arguments.callers, arguments.seconds)
        print(f"{transport:<32} {rate:>8.0f} {front_end:>17.1f} {engine:>14.1f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
