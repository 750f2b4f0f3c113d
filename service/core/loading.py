"""Loading a model here: its ONNX Runtime instances, warmed up, behind a batcher in this process.

Only a lone server and the engine process load models; front-end processes never import this
module, nor ONNX Runtime with it. What is loaded is the core's part of a model: no tokenizer, no image
preprocessing. A two-tower model's image tower is a queue of its own within the model (`image_batcher`): image
rows batch with image rows only, on the image graph's instances, under the same batching settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from service.core.batcher import Batcher
from service.core.placement import InstanceInfo
from service.core.policy import BatchingPolicy, batching_policy, warm_up_shapes
from service.core.repository import ModelSpec, read_model
from service.core.rows import IMAGE_ROW_TOKENS
from service.core.runtime import ExecutionSettings, ModelRuntime, create_instances
from service.ops.metrics import ModelLabels
from service.ops.settings import Settings


@dataclass(frozen=True)
class LoadedModel:
    """A model loaded here: what it is, how it batches, where its instances run, and its batcher."""

    spec: ModelSpec
    policy: BatchingPolicy
    instances: tuple[InstanceInfo, ...]
    batcher: Batcher
    image_batcher: Batcher | None = None
    """The image tower's queue (a two-tower model); None: the model takes no images."""

    @property
    def batchers(self) -> tuple[Batcher, ...]:
        """Every queue of the model: its text (or token) rows', then its images'."""
        return (self.batcher,) if self.image_batcher is None else (self.batcher, self.image_batcher)


def execution_settings(settings: Settings) -> ExecutionSettings:
    """Where and how the model's sessions run, from the server settings."""
    return ExecutionSettings(
        device=settings.device,
        require_gpu=settings.require_gpu,
        variant=settings.variant,
        intra_op_threads=settings.resolved_intra_op_threads(),
        allow_spinning=settings.allow_spinning,
        cuda_device_id=settings.cuda_device_id,
        gpu_mem_limit_bytes=settings.gpu_mem_limit_bytes,
        arena_extend_strategy=settings.arena_extend_strategy,
        cudnn_conv_algo_search=settings.cudnn_conv_algo_search,
    )


def load_model(directory: Path, settings: Settings) -> LoadedModel:
    """Read a model folder, create its instances behind a batcher here, warm them up (blocking).

    RepositoryError or ExecutionError when it cannot be served. The batcher is started by the
    caller, on its event loop.
    """
    spec = read_model(directory)
    runtimes = create_instances(spec, execution_settings(settings), settings.instances)
    policy = batching_policy(spec, settings, runtimes[0].device)
    if settings.warmup:
        shapes = warm_up_shapes(spec, policy)
        for runtime in runtimes:
            runtime.warm_up(shapes)
    labels = ModelLabels(spec.name, spec.version)
    batcher = Batcher(runtimes, policy, labels, spec.output_names)
    instances = tuple(InstanceInfo(r.provider, r.variant, r.settings.cuda_device_id) for r in runtimes)
    image_batcher = _image_batcher(spec, settings, runtimes[0], policy, labels) if spec.image_variants else None
    return LoadedModel(spec, policy, instances, batcher, image_batcher)


def image_policy(policy: BatchingPolicy) -> BatchingPolicy:
    """The image tower's batching: the model's limits, every row one position long (nothing padded or bucketed)."""
    return dataclasses.replace(policy, length_bucket=1, max_length=IMAGE_ROW_TOKENS, pad_token_id=0)


def _image_batcher(
    spec: ModelSpec, settings: Settings, text: ModelRuntime, policy: BatchingPolicy, labels: ModelLabels
) -> Batcher:
    """A two-tower model's image tower behind its own batcher: as many instances, on the text graph's device.

    In the text graph's variant, held to the fidelity rule where the server chose it (service.core.runtime).
    """
    by_default = settings.variant == "auto"
    pinned = text.pinned_settings()
    runtimes = create_instances(spec, pinned, settings.instances, image=True, chosen_by_default=by_default)
    images = image_policy(policy)
    if settings.warmup:
        for runtime in runtimes:
            runtime.warm_up([(1, IMAGE_ROW_TOKENS), (images.max_batch_size, IMAGE_ROW_TOKENS)])
    return Batcher(runtimes, images, labels, ("embedding",))
