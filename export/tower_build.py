"""A two-tower model (CLIP, SigLIP) -> its towers' graphs -> the towers' gate -> a model repository entry.

The text tower's graph is published as the model's graph (model.onnx: input_ids, attention_mask -> embedding)
and the image tower's beside it (image.onnx: pixel_values -> embedding), with the folder's
preprocessor_config.json and tokenizer (service.core.repository describes the layout). Only fp32 is built:
int8 and fp16 are not gated for the towers yet, so they are withdrawn with that reason in parity.json, as
the fidelity rule withdraws a variant elsewhere. The gate (export.gate.towers) holds each tower to
transformers' model of the folder with its own processor, and each graph to the tower and to transformers;
any miss refuses the export (GateRefused), the repository untouched.

As in export.build, what needs PyTorch runs first, one model at a time: transformers answers and is let go,
then our towers are built, exported and answer, and are let go before any ONNX Runtime session is made.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from export.checkpoints import library_tokenizer
from export.checkpoints.checkpoint import Checkpoint
from export.checkpoints.sentence_transformers_folder import FolderError
from export.checkpoints.two_tower_folder import image_processor_settings
from export.families.two_tower import TwoTowerConfig
from export.gate import cases
from export.gate.image_cases import image_cases
from export.gate.parity import GateRefused
from export.gate.towers import TowerFigures, check_tower, library_answers, model_answers, random_text_rows, text_rows
from export.graph.forms import FP32_GRAPH_OPTIMIZATION
from export.graph.onnx_export import OPSET
from export.graph.timing import cpu_session
from export.graph.towers import export_tower
from export.publish import build_config, declare_image_tower, publish
from export.sources import UnusableSource
from service.core.fidelity import FidelityReference
from service.core.repository import RepositoryError
from service.pipeline.images import PREPROCESSOR_CONFIG, FixedSize, ImagePreprocessor

if TYPE_CHECKING:
    from export.build import ExportOptions

TOWERS = ("image", "text")
TOWER_STAGES = 6
"""The stages export_towers announces."""
BUILT_VARIANTS = ("fp32",)
NOT_BUILT = "not built for two-tower models: only fp32 is gated for their towers yet"
"""Why a requested int8 or fp16 is withdrawn (parity.json's withdrawn)."""

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
        withdrawn = {variant: {"reason": NOT_BUILT} for variant in options.variants if variant not in BUILT_VARIANTS}
        for variant in withdrawn:
            log.warning("%s not published: %s", variant, NOT_BUILT)
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
        report = _report(checkpoint, preprocessor, figures, withdrawn)
        text = inputs["text"]
        fidelity = FidelityReference(feed=text.served_feed, labels=text.labels, embedding=ours["text"][1])
        stage("publish")
        preferred = {"cpu": "fp32", "cuda": "fp32"}
        model_config = build_config(checkpoint, ["input_ids", "attention_mask"], ["fp32"], preferred, options.serving)
        declare_image_tower(model_config, checkpoint, ["fp32"], PREPROCESSOR_CONFIG)
        target = publish(
            repository,
            checkpoint,
            model_config,
            {"fp32": graphs["text"]},
            parity=report,
            fidelity=fidelity,
            embedding_ranges={},
            image_variant_files={"fp32": graphs["image"]},
            shipped_files=(preprocessor_file,),
        )
    log.info("published %s", target)
    return report


def _report(
    checkpoint: Checkpoint, preprocessor: ImagePreprocessor, figures: dict[str, TowerFigures], withdrawn: dict
) -> dict[str, object]:
    """parity.json of a two-tower model: each tower's figures (export.gate.towers), on the CPU, in fp32."""
    basis = "fidelity rule: fp32; int8 and fp16 are not built for two-tower models"
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
        "variants": {"fp32": {"passed": True, "provider": "CPUExecutionProvider"}},
        "withdrawn": withdrawn,
        "preferred_variants": {"cpu": "fp32", "cuda": "fp32"},
        "preferred_variants_basis": {device: {"variant": "fp32", "basis": basis} for device in ("cpu", "cuda")},
    }
