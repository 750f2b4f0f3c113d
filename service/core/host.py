"""The models the engine process runs: found in the repository, loaded here, their batchers, their drain.

Only what the core needs: no tokenizer, no answer budget, no request counting (the front ends do
those). A lone server's pipeline loads its models through the same `load_model`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from service.core.batcher import Batcher
from service.core.repository import served_names
from service.errors import InvalidArgument, NotFound
from service.ops import metrics
from service.ops.metrics import ModelLabels
from service.ops.settings import Settings

if TYPE_CHECKING:
    from service.core.loading import LoadedModel


class ModelHost:
    """The repository's models loaded in this process, each behind its batcher."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._models: dict[str, LoadedModel] = {}
        self.folders: dict[str, Path] = {}
        """Folders of models not in the repository (served by name), by name."""

    def discover(self) -> list[str]:
        """The models to serve: the repository's folders, by name, then those given by name (--model)."""
        return served_names(self.settings)

    def folder(self, name: str) -> Path:
        """A model's folder: in the repository, or (a model served by name) its export cache entry once exported."""
        return self.folders.get(name, self.settings.model_repository / name)

    async def load(self, name: str) -> LoadedModel:
        """Load and warm one model off the event loop, and start its batcher here (RepositoryError, ExecutionError)."""
        # Here, not at the top: every process imports the entry point that imports this module, and only the
        # process that loads models maps ONNX Runtime (~18 MB each).
        from service.core.loading import load_model  # noqa: PLC0415

        model = await asyncio.get_running_loop().run_in_executor(None, load_model, self.folder(name), self.settings)
        for batcher in model.batchers:
            batcher.start()
        self._models[name] = model
        labels = ModelLabels(model.spec.name, model.spec.version)
        metrics.report_in_service(labels, ((i.provider, i.variant) for i in model.instances))
        return model

    def batcher(self, name: str, version: str = "", *, images: bool = False) -> Batcher:
        """A loaded model's batcher, or its image tower's (NotFound for a name or version not loaded here).

        InvalidArgument for images to a model without an image tower.
        """
        model = self._models.get(name)
        if model is None:
            raise NotFound(f"unknown model {name!r}")
        if version not in ("", model.spec.version):
            raise NotFound(f"model {name} has no version {version!r} (served: {model.spec.version})")
        if not images:
            return model.batcher
        if model.image_batcher is None:
            raise InvalidArgument(f"model {name} has no image tower: it takes no images")
        return model.image_batcher

    def serving(self, name: str) -> bool:
        """Whether that model is loaded and each of its batchers (its image tower's too) has an instance in service."""
        model = self._models.get(name)
        return model is not None and all(batcher.serving for batcher in model.batchers)

    def on_serving_change(self, name: str, listener: Callable[[bool], None]) -> None:
        """Tell `listener(serving(name))` when any of the model's batchers loses, or gets back, its last instance.

        A stuck image batch takes the model out of service as a stuck text batch does.
        """
        for batcher in self._models[name].batchers:
            batcher.on_serving_change = lambda _batcher_serving: listener(self.serving(name))

    def flush(self) -> None:
        """Queued rows of every model run from now on without waiting for fuller batches (a drain)."""
        for model in self._models.values():
            for batcher in model.batchers:
                batcher.flush()

    async def close(self, timeout_s: float) -> None:
        """Let every model's queued and running rows finish (up to timeout_s), then stop its batcher."""
        self.flush()
        closing = [batcher.close(timeout_s) for model in self._models.values() for batcher in model.batchers]
        await asyncio.gather(*closing)
        for model in self._models.values():
            metrics.MODEL_READY.labels(model.spec.name, model.spec.version).set(0)
