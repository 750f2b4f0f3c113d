"""The engine process of a server of several processes: the models, their batchers, one socket for the front ends.

It loads the repository's models as a lone server does, tells every front end each model's state
(LOADING, READY with its batching and instances, UNAVAILABLE, in service or not), and runs the rows
(token rows, or images for a model's image tower) the front ends send: rows from every front end join the same
batches. A front end whose socket closes has its requests dropped, as a client that goes away does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from service.core.host import ModelHost
from service.core.named_models import export, named_models
from service.core.repository import RepositoryError
from service.core.rows import Rows, WorkItem, WorkResult
from service.core.wire import EngineConnection, EngineServer, Instance, ModelUpdate, Submit
from service.errors import INTERNAL_MESSAGE, ExecutionError, ModelFailure, ServiceError
from service.ops import metrics, tracing
from service.ops.settings import Settings

if TYPE_CHECKING:
    from service.core.loading import LoadedModel

log = logging.getLogger(__name__)

GC_YOUNG_THRESHOLD = 10_000
"""Net container allocations between the engine's young-generation collections (CPython: 700).

Requests' objects are freed by reference counting as they are answered; the collector is only for
cycles, and at CPython's threshold it walked every in-flight request's objects many times a second
under load (docs/decisions.md#engine-gc-threshold).
"""


class EngineProcess:
    """The engine process's side of every front end's requests: rows into the batchers, outputs back."""

    def __init__(self, host: ModelHost) -> None:
        self.host = host
        self.server = EngineServer(self._submit, self._cancel, self._lost, self._flush)
        self._on_done = self._done  # bound once, not per request
        self._items: dict[EngineConnection, dict[int, WorkItem]] = {}
        """Each front end's requests in the batchers, by request id; each item's `owner` is
        (its front end, its request id, the batcher holding it)."""

    def _submit(self, connection: EngineConnection, message: Submit, rows: Rows) -> None:
        try:
            queue = self.host.batcher(message.model, message.version, images=bool(message.pixels))
            trace = None if message.trace is None else tracing.from_wire(message.trace)
            item = queue.enqueue(
                rows, message.outputs, message.deadline, on_done=self._on_done, trace=trace, share=message.share
            )
        except ServiceError as error:
            connection.fail(message.id, error)
            return
        item.owner = (connection, message.id, queue)
        self._items.setdefault(connection, {})[message.id] = item

    def _done(self, item: WorkItem, result: WorkResult | None, error: Exception | None) -> None:
        connection, request_id, _ = item.owner
        self._items[connection].pop(request_id, None)
        if error is None:
            connection.answer(request_id, result)
        elif isinstance(error, ServiceError):
            connection.fail(request_id, error)
        else:
            log.error("request %d failed", request_id, exc_info=error)
            connection.fail(request_id, ModelFailure(INTERNAL_MESSAGE))

    def _cancel(self, connection: EngineConnection, request_id: int) -> None:
        item = self._items.get(connection, {}).pop(request_id, None)
        if item is not None:
            _, _, queue = item.owner
            queue.cancel(item)

    def _flush(self) -> None:
        """A front end is draining, so is the server: queued rows run without waiting for fuller batches."""
        self.host.flush()

    def _lost(self, connection: EngineConnection) -> None:
        for item in self._items.pop(connection, {}).values():
            _, _, queue = item.owner
            queue.cancel(item)

    def announce(self, name: str, state: str, reason: str = "", model: LoadedModel | None = None) -> None:
        """Tell every front end a model's state."""
        if model is None:
            self.server.publish(ModelUpdate(name, "", state, reason, False, None, ()))
            return
        instances = tuple(Instance(i.provider, i.variant, i.cuda_device_id) for i in model.instances)
        policy = dataclasses.asdict(model.policy)
        serving = self.host.serving(name)
        folder = str(self.host.folder(name))
        self.server.publish(ModelUpdate(name, model.spec.version, state, reason, serving, policy, instances, folder))

    def serving_listener(self, name: str, model: LoadedModel) -> Callable[[bool], None]:
        """What to do when a model loses, or gets back, its last working instance: tell the front ends."""
        return lambda serving: self.announce(name, "READY", model=model)


async def run_engine(settings: Settings, socket_path: str) -> int:
    """Load the models, serve the front ends' rows until SIGTERM, then finish accepted work and exit."""
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    host = ModelHost(settings)
    role = EngineProcess(host)
    await role.server.start(socket_path)
    lag = asyncio.ensure_future(metrics.watch_event_loop_lag())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    names = host.discover()
    for name in names:
        role.announce(name, "LOADING")
    # Every front end is listening (NOT_SERVING) before the models load, as a lone server binds first.
    waiting = asyncio.ensure_future(role.server.all_connected(settings.frontends))
    await asyncio.wait((waiting, asyncio.ensure_future(stop.wait())), return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if not stop.is_set():
        # Exports take minutes: a SIGTERM meanwhile stops them (and the server) rather than waiting for them.
        loading = asyncio.ensure_future(_load_models(host, role, names))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait((loading, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            loading.cancel()
        await asyncio.gather(loading, return_exceptions=True)
        if not loading.cancelled() and loading.exception() is not None:
            raise loading.exception()
    await stop.wait()
    log.info("draining (up to %.0f s)", settings.drain_timeout_s)
    await host.close(settings.drain_timeout_s)
    role.server.close()
    lag.cancel()
    log.info("stopped")
    return 0


async def _load_models(host: ModelHost, role: EngineProcess, names: list[str]) -> None:
    """Load each model (exporting those given by name first), telling the front ends each one's state."""
    by_name = {model.name: model for model in named_models(host.settings)}
    for name in names:
        try:
            if name in by_name:
                host.folders[name] = await export(
                    by_name[name], host.settings, lambda why, name=name: role.announce(name, "LOADING", why)
                )
            model = await host.load(name)
        except (RepositoryError, ExecutionError) as error:
            role.announce(name, "UNAVAILABLE", str(error))
            raise
        host.on_serving_change(name, role.serving_listener(name, model))
        role.announce(name, "READY", model=model)
        log.info("model %s version %s ready (%s, %s)", name, model.spec.version, *_placement(model))


def _placement(model: LoadedModel) -> tuple[str, str]:
    first = model.instances[0]
    return first.variant, first.provider
