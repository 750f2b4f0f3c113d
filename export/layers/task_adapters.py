"""Task adapters: LoRA deltas chosen per token by an adapter id, applied in the graph beside the base weights.

A LoRA adapter adds to a linear map W the low-rank delta (x·A)·B·s (A [in, r], B [r, out], s its
scale: lora_alpha / r, or lora_alpha / √r with rsLoRA); on an embedding, the rows of A picked by
the token ids, then ·B·s. Several tasks' adapters of one module are held side by side: their A
joined along the rank ("columns"), their B stacked to match, each column labelled with its task's
id (1, 2, ...; 0 is no adapter) and scale. A token with adapter id t keeps only task t's columns:
delta = ((x·A) ⊙ w)·B, w a column's scale where its task is t and 0 elsewhere. A module made of
several checkpoint modules (Q, K and V in one matrix) holds each part's B in that part's output
slice. The adapters are read from PEFT's folders (`adapter_config.json` + `adapter_model.safetensors`,
one sub-folder per task, as jinaai/jina-embeddings-v3-hf ships them); a PEFT setting that changes
the delta in another way (DoRA, LoRA biases, modules_to_save…) is refused by name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
JINA_TASKS = {
    "retrieval_query": "retrieval.query",
    "retrieval_passage": "retrieval.passage",
    "separation": "separation",
    "classification": "classification",
    "text_matching": "text-matching",
}
"""jina-embeddings-v3-hf's adapter folders -> the task names Jina's API and prompts use, in Jina's order."""
UNSUPPORTED_SETTINGS = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "alpha_pattern",
    "target_parameters",
    "layer_replication",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
)
"""PEFT settings that change the delta beyond (x·A)·B·s: each must be unset (false, null or empty)."""
_WRAPPERS = ("base_model.model.", "model.", "roberta.")
_WEIGHT = re.compile(r"^(.+)\.(lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint module's delta lands: the encoder's module, and which part of its output."""

    module: str
    part: int = 0
    parts: int = 1


def _setting_is_set(value: object) -> bool:
    return value not in (None, False, {}, [], "")


def _scale(config: dict, rank: int, where: Path) -> float:
    """The scale s of one module with rank r: lora_alpha / r, or lora_alpha / √r with rsLoRA."""
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ArchitectureError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _check_config(config: dict, where: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ArchitectureError(f"{where}: unsupported peft_type {config.get('peft_type')!r} (only LORA)")
    if config.get("bias", "none") != "none":
        raise ArchitectureError(f"{where}: unsupported bias {config['bias']!r} (only 'none')")
    for key in UNSUPPORTED_SETTINGS:
        if _setting_is_set(config.get(key)):
            raise ArchitectureError(f"{where}: unsupported {key} {config[key]!r} (only unset)")


@dataclass
class _Block:
    """One task's delta on one part of a module: A [in, r] and B [r, out_part], with s."""

    task_id: int
    part: int
    parts: int
    down: Tensor
    up: Tensor
    scale: float


def _read_folder(folder: Path, task_id: int, targets: dict[str, Target], blocks: dict[str, list[_Block]]) -> None:
    """Add one task's blocks (read from its PEFT folder) to `blocks`, by the encoder's module."""
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise ArchitectureError(f"{config_path}: unreadable ({error})") from error
    _check_config(config, config_path)
    if not weights_path.is_file():
        raise ArchitectureError(f"{folder}: no {ADAPTER_WEIGHTS}")
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        name = next((key[len(p) :] for p in _WRAPPERS if key.startswith(p)), key)
        name = next((name[len(p) :] for p in _WRAPPERS if name.startswith(p)), name)
        match = _WEIGHT.match(name)
        if match is None:
            raise ArchitectureError(f"{weights_path}: unexpected weight {key!r}")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor.to(torch.float32)
    for module, pair in pairs.items():
        if module not in targets:
            supported = ", ".join(sorted({t.split(".")[-1] for t in targets}))
            raise ArchitectureError(f"{weights_path}: LoRA on {module!r} is not implemented (only on {supported})")
        embedding = "lora_embedding_A" in pair
        a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A.weight", "lora_B.weight")
        if set(pair) != {a_key, b_key}:
            raise ArchitectureError(f"{weights_path}: {module} needs both {a_key} and {b_key}, has {sorted(pair)}")
        down, up = pair[a_key], pair[b_key]  # A [r, in] (embedding: [r, vocab]), B [out, r]
        target = targets[module]
        blocks.setdefault(target.module, []).append(
            _Block(task_id, target.part, target.parts, down.T, up.T, _scale(config, down.shape[0], config_path))
        )


@dataclass(frozen=True)
class TaskAdapters:
    """The tasks served (id = position + 1; 0 is no adapter) and each adapted module's joined LoRA weights."""

    tasks: tuple[str, ...]
    weights: dict[str, dict[str, Tensor]]
    """The encoder's module -> its TaskLora's state (down, up, column_task, column_scale)."""

    @property
    def columns(self) -> tuple[tuple[str, int], ...]:
        """Each adapted module and its number of columns (the ranks of every task and part, summed)."""
        return tuple((module, state["down"].shape[1]) for module, state in sorted(self.weights.items()))


def adapter_folders(folder: Path) -> list[Path]:
    """The sub-folders of a model folder holding a PEFT adapter, Jina's tasks first (in Jina's order)."""
    found = {child.name: child for child in folder.iterdir() if (child / ADAPTER_CONFIG).is_file()}
    known = [found[name] for name in JINA_TASKS if name in found]
    return known + [found[name] for name in sorted(found) if name not in JINA_TASKS]


def read_task_adapters(
    folder: Path, targets: dict[str, Target], encoder_shapes: dict[str, tuple[int, int]]
) -> TaskAdapters:
    """The adapters of every task folder in `folder`, joined per module of the encoder.

    targets: checkpoint module -> where its delta lands; encoder_shapes: the encoder's module ->
    (in, out) (for an embedding: (vocabulary, width)).
    """
    folders = adapter_folders(folder)
    blocks: dict[str, list[_Block]] = {}
    for task_id, task_folder in enumerate(folders, start=1):
        _read_folder(task_folder, task_id, targets, blocks)
    weights = {}
    for module, module_blocks in blocks.items():
        width_in, width_out = encoder_shapes[module]
        downs, ups, tasks, scales = [], [], [], []
        for block in module_blocks:
            part_width = width_out // block.parts
            if block.down.shape[0] != width_in or block.up.shape[1] != part_width:
                raise ArchitectureError(
                    f"{folder}: a LoRA of {module} (part {block.part}) has A {tuple(block.down.shape)} and"
                    f" B {tuple(block.up.shape)}, the module is [{width_in}, {part_width}]"
                )
            up = torch.zeros(block.up.shape[0], width_out)
            up[:, block.part * part_width : (block.part + 1) * part_width] = block.up
            downs.append(block.down)
            ups.append(up)
            rank = block.down.shape[1]
            tasks.append(torch.full((rank,), float(block.task_id)))
            scales.append(torch.full((rank,), block.scale))
        weights[module] = {
            "down": torch.cat(downs, dim=1),
            "up": torch.cat(ups, dim=0),
            "column_task": torch.cat(tasks),
            "column_scale": torch.cat(scales),
        }
    tasks = tuple(JINA_TASKS.get(f.name, f.name) for f in folders)
    return TaskAdapters(tasks, weights)


class TaskLora(nn.Module):
    """The LoRA deltas of every task on one module; each token keeps its own task's (none for id 0)."""

    def __init__(self, width_in: int, width_out: int, columns: int, embedding: bool = False) -> None:
        super().__init__()
        self.embedding = embedding
        self.down = nn.Parameter(torch.zeros(width_in, columns), requires_grad=False)
        self.up = nn.Parameter(torch.zeros(columns, width_out), requires_grad=False)
        self.register_buffer("column_task", torch.zeros(columns))
        self.register_buffer("column_scale", torch.zeros(columns))

    def forward(self, x: Tensor, adapter_ids: Tensor) -> Tensor:
        """The delta for x [batch, seq, in] (an embedding: ids [batch, seq]); adapter_ids [batch, seq]."""
        low = F.embedding(x, self.down) if self.embedding else torch.matmul(x, self.down)
        kept = (adapter_ids.unsqueeze(-1).to(low.dtype) == self.column_task.to(low.dtype)).to(low.dtype)
        return torch.matmul(low * (kept * self.column_scale.to(low.dtype)), self.up.to(low.dtype))
