"""Drive a KServe v2 gRPC server: check it is ready, then run one load level (closed or open loop).

Everything runs on one asyncio loop over one grpc.aio channel. A request belongs to the measured
window when it was sent (open loop: scheduled) after the warm-up and before the window closed;
requests still in flight when it closes are awaited and counted. Throughput is measured requests
divided by the window, which in steady state balances the warm-up requests finishing inside the
window against the window's requests finishing after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import numpy as np
from tqdm import tqdm

from client import MAX_MESSAGE_BYTES
from client.protocol import channel_options
from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tools.loadtest.config import Level, LoadConfig
from tools.loadtest.result import LevelResult
from tools.loadtest.workload import PreparedRequest, Workload

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5


class TargetError(RuntimeError):
    """The target cannot be used: unreachable, not ready, or without the model or its inputs."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _open_channel(config: LoadConfig) -> grpc.aio.Channel:
    # No transparent retries: every failed attempt is counted, and latency is one attempt's.
    options = [*channel_options(config.target, MAX_MESSAGE_BYTES), ("grpc.enable_retries", 0)]
    return config.security.aio_channel(config.target, options)


async def check_target(config: LoadConfig, workload: Workload) -> pb.ModelMetadataResponse:
    """Fail with TargetError unless the server and model are ready and the model takes the workload's inputs."""
    async with _open_channel(config) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = {"timeout": config.timeout_s, "metadata": config.security.metadata()}
        try:
            server_ready = await stub.ServerReady(pb.ServerReadyRequest(), **call)
            if not server_ready.ready:
                raise TargetError(f"server at {config.target} is not ready")
            model_ready = await stub.ModelReady(pb.ModelReadyRequest(name=config.model), **call)
            if not model_ready.ready:
                raise TargetError(f"model {config.model!r} is not ready at {config.target}")
            metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name=config.model), **call)
        except grpc.aio.AioRpcError as error:
            details = _one_line(error.details() or "")
            raise TargetError(f"cannot use {config.target}: {error.code().name}: {details}") from None
    declared_inputs = {tensor.name: tensor.datatype for tensor in metadata.inputs}
    for name, datatype in workload.inputs.items():
        if declared_inputs.get(name) != datatype:
            raise TargetError(f"model {config.model!r} has no {datatype} input {name!r} (inputs: {declared_inputs})")
    declared_outputs = {tensor.name for tensor in metadata.outputs}
    for name in workload.outputs:
        if name not in declared_outputs:
            raise TargetError(f"model {config.model!r} has no output {name!r} (outputs: {sorted(declared_outputs)})")
    logger.info("target %s ready: model %s versions %s", config.target, metadata.name, list(metadata.versions))
    return metadata


class _Tally:
    """Outcomes of the requests sent inside the measured window [measure_from, measure_until)."""

    def __init__(self, measure_from: float, measure_until: float) -> None:
        self.measure_from = measure_from
        self.measure_until = measure_until
        self.latencies_s: list[float] = []
        self.sequences = 0
        self.failures: Counter[str] = Counter()
        self.dropped = 0
        self.completed_all = 0
        self.failed_all = 0

    def record(self, sent_at: float, latency_s: float, code: str | None, sequences: int) -> None:
        self.completed_all += 1
        if code is not None:
            self.failed_all += 1
        if not self.measure_from <= sent_at < self.measure_until:
            return
        if code is None:
            self.latencies_s.append(latency_s)
            self.sequences += sequences
        else:
            self.failures[code] += 1

    def drop(self, scheduled_at: float) -> None:
        if self.measure_from <= scheduled_at < self.measure_until:
            self.dropped += 1

    def result(self, config: LoadConfig, level: Level) -> LevelResult:
        succeeded = len(self.latencies_s)
        failed = sum(self.failures.values())
        percentiles: list[float | None] = [None] * 5
        if succeeded:
            values = np.percentile(np.asarray(self.latencies_s) * 1e3, [50, 90, 95, 99, 100])
            percentiles = [round(float(value), 3) for value in values]
        duration_s = config.duration_s
        return LevelResult(
            mode=level.mode,
            level=level.value,
            label=level.label,
            duration_s=duration_s,
            requests_sent=succeeded + failed,
            succeeded=succeeded,
            failed=failed,
            failures_by_code=dict(sorted(self.failures.items())),
            dropped=self.dropped,
            sequences=self.sequences,
            offered_rps=round((succeeded + failed + self.dropped) / duration_s, 3),
            throughput_rps=round(succeeded / duration_s, 3),
            sequences_per_s=round(self.sequences / duration_s, 3),
            latency_p50_ms=percentiles[0],
            latency_p90_ms=percentiles[1],
            latency_p95_ms=percentiles[2],
            latency_p99_ms=percentiles[3],
            latency_max_ms=percentiles[4],
        )


async def _send(stub: pb_grpc.GRPCInferenceServiceStub, request: PreparedRequest, config: LoadConfig) -> str | None:
    """None on success, else the gRPC status code's name."""
    try:
        await stub.ModelInfer(request.message, timeout=config.timeout_s, metadata=config.security.metadata())
    except grpc.aio.AioRpcError as error:
        return error.code().name
    return None


async def _closed_worker(
    stub: pb_grpc.GRPCInferenceServiceStub, requests: Iterator[PreparedRequest], tally: _Tally, config: LoadConfig
) -> None:
    """Send the next request as soon as the previous one is answered, until the window closes."""
    while (sent_at := time.perf_counter()) < tally.measure_until:
        request = next(requests)
        code = await _send(stub, request, config)
        tally.record(sent_at, time.perf_counter() - sent_at, code, request.sequences)


async def _closed_stream_worker(
    stub: pb_grpc.GRPCInferenceServiceStub, requests: Iterator[PreparedRequest], tally: _Tally, config: LoadConfig
) -> None:
    """Closed loop over one ModelStreamInfer stream: the next request goes when the previous one's answer arrives.

    A request answered with `error_message` counts as STREAM_ERROR; one with no answer within
    timeout_s as DEADLINE_EXCEEDED; a stream the server ends or breaks counts its status and is reopened.
    """
    while time.perf_counter() < tally.measure_until:
        stream = stub.ModelStreamInfer(metadata=config.security.metadata())
        try:
            while (sent_at := time.perf_counter()) < tally.measure_until:
                request = next(requests)
                await stream.write(request.message)
                try:
                    response = await asyncio.wait_for(stream.read(), config.timeout_s)
                except asyncio.TimeoutError:
                    tally.record(sent_at, time.perf_counter() - sent_at, "DEADLINE_EXCEEDED", request.sequences)
                    break
                if response is grpc.aio.EOF:
                    tally.record(sent_at, time.perf_counter() - sent_at, "STREAM_ENDED", request.sequences)
                    break
                code = "STREAM_ERROR" if response.error_message else None
                tally.record(sent_at, time.perf_counter() - sent_at, code, request.sequences)
        except grpc.aio.AioRpcError as error:
            tally.record(sent_at, time.perf_counter() - sent_at, error.code().name, request.sequences)
        finally:
            stream.cancel()


async def _timed_send(
    stub: pb_grpc.GRPCInferenceServiceStub,
    request: PreparedRequest,
    scheduled_at: float,
    tally: _Tally,
    config: LoadConfig,
) -> None:
    """One open-loop request; latency counts from when it was scheduled, so a late send shows up."""
    code = await _send(stub, request, config)
    tally.record(scheduled_at, time.perf_counter() - scheduled_at, code, request.sequences)


async def _open_loop(
    stub: pb_grpc.GRPCInferenceServiceStub,
    requests: Iterator[PreparedRequest],
    tally: _Tally,
    config: LoadConfig,
    *,
    rate_rps: float,
    start: float,
) -> None:
    """Send at Poisson arrival times whatever is outstanding; drop (and count) beyond max_outstanding."""
    arrivals = random.Random(config.seed)
    outstanding: set[asyncio.Task[None]] = set()
    scheduled_at = start + arrivals.expovariate(rate_rps)
    while scheduled_at < tally.measure_until:
        delay_s = scheduled_at - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if len(outstanding) >= config.max_outstanding:
            tally.drop(scheduled_at)
        else:
            task = asyncio.create_task(_timed_send(stub, next(requests), scheduled_at, tally, config))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
        scheduled_at += arrivals.expovariate(rate_rps)
    if outstanding:
        await asyncio.gather(*outstanding)


async def _show_progress(bar: tqdm, tally: _Tally, level: Level, start: float) -> None:
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        now = time.perf_counter()
        bar.n = round(min(bar.total, now - start), 1)
        phase = "warm-up" if now < tally.measure_from else "measuring"
        bar.set_description_str(f"{level.label} {phase}", refresh=False)
        bar.set_postfix(done=tally.completed_all, failed=tally.failed_all, refresh=False)
        bar.refresh()


async def run_level(config: LoadConfig, level: Level, workload: Workload) -> LevelResult:
    """Run one level: warm-up, then the measured window; returns what was measured in that window."""
    async with _open_channel(config) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), config.timeout_s)
        except asyncio.TimeoutError:
            logger.warning("channel to %s not ready after %.1f s; sending anyway", config.target, config.timeout_s)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        requests = itertools.cycle(workload.requests)
        start = time.perf_counter()
        tally = _Tally(start + config.warmup_s, start + config.warmup_s + config.duration_s)
        bar = tqdm(
            total=config.warmup_s + config.duration_s,
            desc=level.label,
            unit="s",
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s{postfix}",
            file=sys.stderr,
            leave=False,
            disable=not config.progress,
        )
        progress = asyncio.create_task(_show_progress(bar, tally, level, start)) if config.progress else None
        try:
            if level.mode == "closed":
                worker = _closed_stream_worker if config.streaming else _closed_worker
                workers = (worker(stub, requests, tally, config) for _ in range(level.concurrency))
                await asyncio.gather(*workers)
            else:
                await _open_loop(stub, requests, tally, config, rate_rps=level.value, start=start)
        finally:
            if progress is not None:
                progress.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await progress
            bar.close()
    result = tally.result(config, level)
    logger.info(
        "%s: %d ok, %d failed, %.1f req/s, p50 %s ms, p99 %s ms (%d requests finished in all)",
        level.label,
        result.succeeded,
        result.failed,
        result.throughput_rps,
        result.latency_p50_ms,
        result.latency_p99_ms,
        tally.completed_all,
    )
    return result
