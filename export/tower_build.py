"""A two-tower model (CLIP, SigLIP) -> its towers' graphs -> the towers' gate -> a model repository entry.

The text tower's graph is published as the model's graph (model.onnx: input_ids, attention_mask -> embedding)
and the image tower's beside it (image.onnx: pixel_values -> embedding), with the folder's
preprocessor_config.json and tokenizer (service.core.towers describes the layout). The gate (export.gate.towers)
holds each tower to transformers' model of the folder with its own processor, and each fp32 graph to the tower and
to transformers; any miss refuses the export (GateRefused), the repository untouched.

The variants are the text models' (export.build): int8 for the CPU (export.graph.quantize, calibrated on the
tower's gate inputs) and fp16 for CUDA (export.graph.forms.write_cuda_fp16 of the unfused graph), each tower's held
to our fp32 tower at its variant's own bar (service.core.fidelity.VARIANT_MIN_COSINE), and int8 besides to the speed
bar (ExportOptions.int8_min_speedup) on each tower. The model's variant applies to both towers, so a variant is
published for both or for neither: one that misses a bar on either tower is withdrawn for both, the tower, the
figure and the row in parity.json's reason (an int8 gate miss withdraws int8 rather than refusing the export:
the towers' int8 is new and an explicit choice only). fp16 is CUDA's default only where both towers meet the
fidelity rule (export.gate.towers.preferred_variants). The image tower's check at load is the text's on a few gate
images (image_fidelity.npz, IMAGE_FIDELITY_ROWS of them): a subset of the gate's rows at the same bar.

As in export.build, what needs PyTorch runs first, one model at a time: transformers answers and is let go,
then our towers are built, exported and answer, and are let go before any ONNX Runtime session is made
(sessions are made one at a time, each let go when its checks are done).
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from export.checkpoints import library_tokenizer
from export.checkpoints.checkpoint import Checkpoint
from export.checkpoints.sentence_transformers_folder import FolderError
from export.checkpoints.two_tower_folder import image_processor_settings
from export.families.two_tower import TwoTowerConfig
from export.gate import cases
from export.gate.image_cases import image_cases
from export.gate.parity import GateRefused
from export.gate.towers import (
    TowerFigures,
    TowerInputs,
    check_tower,
    check_variant,
    library_answers,
    model_answers,
    preferred_variants,
    random_text_rows,
    text_rows,
)
from export.graph.forms import FP32_GRAPH_OPTIMIZATION, cpu_graph_optimization, fp16_form, write_cuda_fp16
from export.graph.onnx_export import OPSET
from export.graph.quantize import quantize_int8
from export.graph.timing import compare_throughput, cpu_session, fp16_session, token_feed
from export.graph.towers import export_tower
from export.publish import build_config, declare_image_tower, publish
from export.sources import UnusableSource
from service.core.fidelity import FidelityReference
from service.core.repository import RepositoryError
from service.core.runtime import CPU, CUDA
from service.core.towers import PIXEL_VALUES
from service.pipeline.images import PREPROCESSOR_CONFIG, FixedSize, ImagePreprocessor

if TYPE_CHECKING:
    from export.build import ExportOptions

TOWERS = ("image", "text")
SPEED_ROWS = 8
"""Rows (images, texts) each tower's int8 is timed against its fp32 on."""
SPEED_TOKENS = 128
"""Tokens per text row the text tower's int8 is timed on (at most the model's max_sequence_length)."""
IMAGE_FIDELITY_ROWS = 4
"""Gate images whose pixel values and fp32 embeddings image_fidelity.npz holds (spread over the gate's cases)."""

log = logging.getLogger(__name__)


def _preprocessor(checkpoint: Checkpoint, config: TwoTowerConfig, scratch: Path) -> tuple[Path, ImagePreprocessor]:
    """The preprocessor_config.json to publish and the server's preprocessing of it, checked against the image tower.

    The folder's image processor settings are read as transformers does (two_tower_folder.image_processor_settings);
    settings nested in processor_config.json are written flat into scratch, as the repository holds them.
    """
    if checkpoint.folder is None:
        raise UnusableSource(f"{checkpoint.model_type}: a two-tower model is exported from its folder only")
    try:
        source, settings = image_processor_settings(checkpoint.folder)
    except FolderError as error:
        raise UnusableSource(f"{checkpoint.model_type}: {error}") from error
    folder = source.parent
    if source.name != PREPROCESSOR_CONFIG:
        folder = scratch / "image-processor"
        folder.mkdir()
        (folder / PREPROCESSOR_CONFIG).write_text(json.dumps(settings, indent=2))
    try:
        preprocessor = ImagePreprocessor.from_folder(folder)
    except RepositoryError as error:
        where = f"{source} (its image_processor)" if source.name != PREPROCESSOR_CONFIG else str(source)
        message = str(error).replace(str(folder / PREPROCESSOR_CONFIG), where)
        raise UnusableSource(f"{checkpoint.model_type}: {message}") from error
    size = config.geometry.image_size
    if preprocessor.output_size != FixedSize(size, size):
        made = preprocessor.output_size
        raise UnusableSource(
            f"{source}: makes {made.width}x{made.height} pixel values, the image tower takes {size}x{size}"
        )
    return folder / PREPROCESSOR_CONFIG, preprocessor


def planned_stages(options: ExportOptions) -> int:
    """How many stages export_towers announces for these options (when every gate passes)."""
    return 6 + ("int8" in options.variants) * 2 + ("fp16" in options.variants)


@dataclass
class TowerVariant:
    """One variant's graph of each tower, the gate's figures on them, and how they were made."""

    graphs: dict[str, Path]
    figures: dict[str, TowerFigures]
    provider: str
    recipe: dict[str, object]

    @property
    def failures(self) -> list[str]:
        """Every tower's misses of the variant's bar."""
        return [failure for tower in TOWERS for failure in self.figures[tower].failures]

    def to_dict(self) -> dict[str, object]:
        """Plain data for parity.json."""
        return {
            "passed": not self.failures,
            "provider": self.provider,
            "towers": {tower: self.figures[tower].to_dict() for tower in TOWERS},
            "recipe": self.recipe,
        }


def _speed_feed(tower: str, inputs: TowerInputs, config: TwoTowerConfig, max_length: int) -> dict[str, np.ndarray]:
    """SPEED_ROWS rows a tower is timed on: the gate's images repeated, or random texts of SPEED_TOKENS tokens."""
    if tower == "image":
        pixels = inputs.served_feed[PIXEL_VALUES]
        return {PIXEL_VALUES: np.resize(pixels, (SPEED_ROWS, *pixels.shape[1:]))}
    names = ["input_ids", "attention_mask"]
    return token_feed(names, SPEED_ROWS, min(SPEED_TOKENS, max_length), config.vocab_size)


@dataclass
class _TowerVariants:
    """The towers' int8 and fp16, built from their fp32 graphs in a scratch folder and gated as they are made."""

    checkpoint: Checkpoint
    options: ExportOptions
    workdir: Path
    graphs: dict[str, Path]
    """Each tower's fp32 graph."""
    inputs: dict[str, TowerInputs]
    fp32: dict[str, np.ndarray]
    """Our fp32 towers' answers on the server's inputs: what each variant is held to."""
    stage: Callable[[str], None]
    built: dict[str, TowerVariant] = field(default_factory=dict)
    withdrawn: dict[str, dict[str, object]] = field(default_factory=dict)
    """variant -> why it was left out (parity.json's withdrawn, with its figures)."""
    speed: dict[str, object] | None = None
    cuda_problem: str | None = None
    """Why CUDA could not run fp16 here (None: it did, or fp16 was not built)."""

    def build(self) -> dict[str, TowerVariant]:
        """Build and gate the requested variants; those that pass every bar (the rest withdrawn, with why)."""
        if "int8" in self.options.variants:
            self.stage("int8: quantisation and parity gate")
            self.built["int8"] = self._int8()
        if "fp16" in self.options.variants:
            self.stage("fp16: build and parity gate")
            self.built["fp16"] = self._fp16()
        for variant, made in self.built.items():
            if made.failures:
                self.withdrawn[variant] = {"reason": "refused by the parity gate: " + "; ".join(made.failures)}
        if "int8" in self.built and "int8" not in self.withdrawn:
            self.stage("int8: speed bar")
            self._int8_speed()
        for variant, why in self.withdrawn.items():
            log.warning("%s not published: %s", variant, why["reason"])
            why.update(self.built[variant].to_dict())
        return {variant: made for variant, made in self.built.items() if variant not in self.withdrawn}

    def preferred(self) -> dict[str, dict[str, object]]:
        """The default per device under the fidelity rule (export.gate.towers.preferred_variants)."""
        fp16 = self.built.get("fp16")
        return preferred_variants(
            None if fp16 is None else fp16.figures,
            None if fp16 is None else fp16.provider,
            self.withdrawn["fp16"]["reason"] if "fp16" in self.withdrawn else None,
            self.cuda_problem,
        )

    def _int8(self) -> TowerVariant:
        """Each tower quantised as the text models are, calibrated on its gate inputs, and gated on the CPU."""
        paths, figures, recipes = {}, {}, {}
        level = cpu_graph_optimization("int8")
        for tower in TOWERS:
            paths[tower] = self.workdir / f"{tower}.int8.onnx"
            recipes[tower] = quantize_int8(self.graphs[tower], paths[tower], [self.inputs[tower].served_feed])
            session = cpu_session(str(paths[tower]), self.options.threads, level)
            figures[tower] = check_variant(tower, "int8", self.inputs[tower], self.fp32[tower], session)
            del session
        return TowerVariant(paths, figures, CPU, {"graph_optimization": level, **recipes})

    def _fp16(self) -> TowerVariant:
        """Each tower converted to fp16 as the text models are, gated on CUDA where usable here, else on the CPU."""
        config = self.checkpoint.config
        paths, figures, provider = {}, {}, CPU
        for tower in TOWERS:
            paths[tower] = self.workdir / f"{tower}.fp16.onnx"
            write_cuda_fp16(self.graphs[tower], paths[tower], config)
            session, self.cuda_problem = fp16_session(paths[tower], self.options.threads)
            provider = session.get_providers()[0]
            figures[tower] = check_variant(tower, "fp16", self.inputs[tower], self.fp32[tower], session)
            del session
        if self.cuda_problem:
            log.warning(
                "the towers' fp16 was checked on the CPU only (CUDA cannot be used here: %s); "
                "the server checks it again on CUDA when it loads it",
                self.cuda_problem,
            )
        return TowerVariant(paths, figures, provider, {"graph_form": fp16_form(config), "target": CUDA})

    def _int8_speed(self) -> None:
        """Each tower's int8 against its fp32 on the CPU, side by side; int8 is withdrawn where a tower misses the bar.

        As for text models (export.build), a variant not worth choosing is left out rather than failing the export.
        """
        towers = {}
        for tower in TOWERS:
            feed = _speed_feed(tower, self.inputs[tower], self.checkpoint.config, self.checkpoint.max_seq_length)
            sessions = {
                variant: cpu_session(str(path), self.options.threads, cpu_graph_optimization(variant))
                for variant, path in (("fp32", self.graphs[tower]), ("int8", self.built["int8"].graphs[tower]))
            }
            rates = compare_throughput(sessions, feed, rounds=5)
            del sessions
            towers[tower] = {
                "shape": "x".join(str(dim) for dim in next(iter(feed.values())).shape),
                "fp32_rows_per_second": round(rates["fp32"], 1),
                "int8_rows_per_second": round(rates["int8"], 1),
                "speedup": round(rates["int8"] / rates["fp32"], 3),
            }
        bar = self.options.int8_min_speedup
        slow = [
            f"{tower} tower: {figures['speedup']}x fp32 at {figures['shape']} is below the {bar}x bar"
            for tower, figures in towers.items()
            if figures["speedup"] < bar
        ]
        self.speed = {"towers": towers, "bar": bar, "published": not slow}
        if slow:
            self.withdrawn["int8"] = {"reason": "; ".join(slow)}


def _image_fidelity(inputs: TowerInputs, fp32: np.ndarray) -> FidelityReference:
    """The image tower's reference for the check at load: IMAGE_FIDELITY_ROWS gate images, the fp32 tower's answers."""
    rows = np.unique(np.linspace(0, len(inputs.labels) - 1, IMAGE_FIDELITY_ROWS).round().astype(int))
    return FidelityReference(
        feed={PIXEL_VALUES: inputs.served_feed[PIXEL_VALUES][rows]},
        labels=tuple(inputs.labels[row] for row in rows),
        embedding=fp32[rows],
    )


def export_towers(
    checkpoint: Checkpoint,
    repository: Path,
    options: ExportOptions,
    stage: Callable[[str], None],
    scratch: Path | None = None,
) -> dict[str, object]:
    """Export both towers, gate them, publish the model; return the parity report (export.build.export_model's)."""
    config: TwoTowerConfig = checkpoint.config
    with tempfile.TemporaryDirectory(prefix="encoder-export-", dir=scratch) as workdir:
        preprocessor_file, preprocessor = _preprocessor(checkpoint, config, Path(workdir))
        stage("load checkpoint")
        checkpoint = library_tokenizer.with_converted_tokenizer(checkpoint, Path(workdir))
        checkpoint = library_tokenizer.with_library_tokenizer(checkpoint, Path(workdir), options.sentences)
        stage("reference library")
        if checkpoint.tokenizer_files:
            sentences = cases.read_sentences(options.sentences)
            served_tokenizer = checkpoint.tokenizer_folder / "tokenizer.json"
            texts = text_rows(checkpoint.folder, config, sentences, checkpoint.max_seq_length, served_tokenizer)
        else:
            texts = random_text_rows(config, checkpoint.max_seq_length)
        images = image_cases(config.geometry.image_size)
        library = {"sentence_transformers_folder": checkpoint.library_folder}
        inputs = library_answers(checkpoint.folder, config, images, texts, preprocessor, **library)
        stage("export to ONNX")
        model = checkpoint.build_model()
        graphs = {tower: Path(workdir) / f"{tower}.onnx" for tower in TOWERS}
        export_tower(model.vision, graphs["image"])
        export_tower(model.text, graphs["text"])
        stage("PyTorch references")
        ours = model_answers(model, inputs)
        del model
        gc.collect()
        stage("fp32: parity gate")
        figures = {}
        for tower in TOWERS:  # one session at a time
            session = cpu_session(str(graphs[tower]), options.threads, FP32_GRAPH_OPTIMIZATION)
            figures[tower] = check_tower(tower, inputs[tower], ours[tower], session)
            del session
        failures = [failure for tower in TOWERS for failure in figures[tower].failures]
        if failures:
            raise GateRefused("parity gate refused: " + "; ".join(failures))
        fp32 = {tower: ours[tower][1] for tower in TOWERS}  # our fp32 towers on the server's inputs
        variants = _TowerVariants(checkpoint, options, Path(workdir), graphs, inputs, fp32, stage)
        published = variants.build()
        report = _report(checkpoint, preprocessor, figures, variants, published)
        text = inputs["text"]
        fidelity = FidelityReference(feed=text.served_feed, labels=text.labels, embedding=fp32["text"])
        stage("publish")
        names = ["fp32", *published]
        choices = report["preferred_variants"]
        model_config = build_config(checkpoint, ["input_ids", "attention_mask"], names, choices, options.serving)
        declare_image_tower(model_config, checkpoint, names, PREPROCESSOR_CONFIG)
        target = publish(
            repository,
            checkpoint,
            model_config,
            {"fp32": graphs["text"]} | {variant: made.graphs["text"] for variant, made in published.items()},
            parity=report,
            fidelity=fidelity,
            embedding_ranges={},
            image_variant_files={"fp32": graphs["image"]}
            | {variant: made.graphs["image"] for variant, made in published.items()},
            image_fidelity=_image_fidelity(inputs["image"], fp32["image"]),
            shipped_files=(preprocessor_file,),
        )
    log.info("published %s", target)
    return report


def _report(
    checkpoint: Checkpoint,
    preprocessor: ImagePreprocessor,
    figures: dict[str, TowerFigures],
    variants: _TowerVariants,
    published: dict[str, TowerVariant],
) -> dict[str, object]:
    """parity.json of a two-tower model: each tower's fp32 figures (export.gate.towers), then each variant's."""
    preferred = variants.preferred()
    return {
        "model": checkpoint.name,
        "source": str(checkpoint.library_folder or checkpoint.folder),
        "reference_library": "sentence-transformers" if checkpoint.library_folder else "transformers",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_type": checkpoint.model_type,
        "task": "embed",
        "encoder": checkpoint.config.to_dict(),
        "max_sequence_length": checkpoint.max_seq_length,
        "onnx": {"exporter": "torch.onnx (TorchScript)", "opset": OPSET, "graph_optimization": FP32_GRAPH_OPTIMIZATION},
        "image_preprocessor": preprocessor.processor_class,
        "towers": {tower: figures[tower].to_dict() for tower in TOWERS},
        "int8_speed": variants.speed,
        "variants": {"fp32": {"passed": True, "provider": CPU}}
        | {variant: made.to_dict() for variant, made in published.items()},
        "withdrawn": variants.withdrawn,
        "preferred_variants": {device: choice["variant"] for device, choice in preferred.items()},
        "preferred_variants_basis": preferred,
    }
