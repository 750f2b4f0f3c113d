"""Models served by the engine process, as a front-end process's pipeline sees them.

A front end reads each model's repository folder itself (its tokenizer, its signature) and hears
from the engine, over its `EngineLink`, whether the model is loading, ready (with the batching in
force and where each instance runs) or unavailable, and whether it is in service. Its rows go to
the engine through a `RemoteQueue` (service.core.remote).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from service.core.placement import InstanceInfo
from service.core.policy import BatchingPolicy
from service.core.remote import RemoteQueue
from service.core.repository import read_model
from service.core.wire import EngineLink, ModelUpdate
from service.pipeline.api import Pipeline
from service.pipeline.models import ServedModel


class RemoteModels:
    """Keeps a front end's engine in step with the engine process: models added as they become ready."""

    def __init__(self, pipeline: Pipeline, on_ready: Callable[[str], None]) -> None:
        self._engine = pipeline
        self._on_ready = on_ready
        self._queues: dict[str, RemoteQueue] = {}
        self.link: EngineLink | None = None

    def update(self, update: ModelUpdate) -> None:
        """A model's state in the engine changed (or is told for the first time)."""
        queue = self._queues.get(update.name)
        if queue is not None:
            queue.set_serving(update.serving)
            return
        if update.state != "READY":
            self._engine.set_state(update.name, update.state, update.reason, update.version)
            return
        settings = self._engine.settings
        spec = read_model(Path(update.folder) if update.folder else settings.model_repository / update.name)
        policy = BatchingPolicy(**update.policy)
        instances = tuple(InstanceInfo(i.provider, i.variant, i.cuda_device_id) for i in update.instances)
        queue = self._queues[update.name] = RemoteQueue(self.link, spec.name, spec.version)
        # One link carries both kinds of rows: the engine puts images in the model's image tower's queue.
        model = ServedModel(
            spec,
            policy,
            instances,
            queue,
            settings=settings,
            tokenizer_pool=self._engine.tokenizer_pool(),
            image_queue=queue if spec.image_variants else None,
        )
        self._engine.add(model)
        queue.set_serving(update.serving)
        self._on_ready(update.name)
