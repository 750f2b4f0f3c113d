"""The two-tower folders the exporter reads (export.checkpoints.two_tower_folder, .library_tokenizer), and what it
refuses by name: sentence-transformers 6's layout, processor_config.json, tokenizers without tokenizer.json.

The source folders are tests.export.two_tower_folders', shared with test_tower_export (which checks their
exports); each test here copies one before changing it.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import sentencepiece

from export.__main__ import main as export_main
from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.checkpoints.two_tower_folder import PROCESSOR_CONFIG
from tests.export.tiny_models import training_sentences
from tests.export.two_tower_folders import MAX_POSITIONS, exported_two_towers

NORMALIZE = {"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}


@pytest.fixture(scope="module")
def sources() -> Path:
    """The shared source folders (source/<name>)."""
    return exported_two_towers() / "source"


def _copy(sources: Path, name: str, tmp_path: Path) -> Path:
    return shutil.copytree(sources / name, tmp_path / name)


def _rewrite(path: Path, change: dict) -> None:
    """A JSON object file with change's keys set (a None value removes the key)."""
    content = json.loads(path.read_text()) | change
    path.write_text(json.dumps({key: value for key, value in content.items() if value is not None}))


def _refusal(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    """The command line's one-line refusal of source; nothing published."""
    status = export_main(["--source", str(source), "--repository", str(tmp_path / "repository"), "--threads", "1"])
    assert status == 2 and not (tmp_path / "repository").exists()
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_sentence_transformers6_folder_is_its_own_model(sources: Path) -> None:
    """sentence-transformers 6 saves the model at the folder root: the folder is the model and the reference."""
    for name in ("st6-clip", "st6-siglip"):
        source = sources / name
        assert not (source / "preprocessor_config.json").exists() and (source / PROCESSOR_CONFIG).is_file()
        checkpoint = load_checkpoint(source)
        assert checkpoint.folder == source.resolve() and checkpoint.library_folder == source
        assert not checkpoint.config.normalize and checkpoint.max_seq_length == MAX_POSITIONS


def test_features_without_an_output_name_are_read_as_transformers_4_wrote_them(sources: Path, tmp_path: Path) -> None:
    """sentence-transformers 6 under transformers 4 writes method_output_name null (the method answers a tensor)."""
    source = _copy(sources, "st6-clip", tmp_path)
    config_file = source / "sentence_bert_config.json"
    modalities = json.loads(config_file.read_text())["modality_config"]
    _rewrite(
        config_file,
        {"modality_config": {key: entry | {"method_output_name": None} for key, entry in modalities.items()}},
    )
    assert load_checkpoint(source).library_folder == source


def test_a_sentence_transformers6_model_is_taken_alone_or_with_normalize_only(sources: Path, tmp_path: Path) -> None:
    source = _copy(sources, "st6-clip", tmp_path)
    modules = json.loads((source / "modules.json").read_text())
    (source / "modules.json").write_text(json.dumps([*modules, NORMALIZE]))
    assert load_checkpoint(source).config.normalize
    (source / "modules.json").write_text(json.dumps([*modules, POOLING]))
    with pytest.raises(CheckpointError, match="modules Transformer -> Pooling: a Transformer is implemented alone"):
        load_checkpoint(source)


def test_siglip_under_sentence_transformers_must_pad_texts_to_max_length(sources: Path, tmp_path: Path) -> None:
    """sentence-transformers' default pads to the batch's longest; SigLIP reads the last position: refused."""
    source = _copy(sources, "st6-siglip", tmp_path)
    _rewrite(source / "sentence_bert_config.json", {"processing_kwargs": None})
    with pytest.raises(CheckpointError, match="sentence-transformers pads texts to the longest in their batch"):
        load_checkpoint(source)


@pytest.mark.parametrize(
    ("file", "change", "message"),
    [
        (
            "sentence_bert_config.json",
            {
                "modality_config": {
                    "text": {"method": "get_text_features", "method_output_name": "pooler_output"},
                    "image": {"method": "forward", "method_output_name": "image_embeds"},
                }
            },
            "modality_config 'image'",
        ),
        ("sentence_bert_config.json", {"module_output_name": "token_embeddings"}, "module_output_name"),
        ("sentence_bert_config.json", {"processing_kwargs": {"image": {"size": 64}}}, "processing_kwargs"),
        ("sentence_bert_config.json", {"processing_kwargs": {"text": {"padding": False}}}, "text padding False"),
        ("sentence_bert_config.json", {"query_expansion": {"length": 8}}, "query_expansion"),
        ("sentence_bert_config.json", {"image_size": 64}, "field 'image_size' is not implemented here"),
        ("config_sentence_transformers.json", {"prompts": {"query": "a photo of "}}, "prompts on a two-tower"),
    ],
)
def test_a_sentence_transformers6_setting_not_implemented_is_refused_by_name(
    sources: Path, tmp_path: Path, file: str, change: dict, message: str
) -> None:
    source = _copy(sources, "st6-clip", tmp_path)
    _rewrite(source / file, change)
    with pytest.raises(CheckpointError, match=message) as refusal:
        load_checkpoint(source)
    assert str(source / file) in str(refusal.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"feature_extractor": {}}, "field 'feature_extractor' is not implemented here"),
        ({"image_processor": {"do_pad": True}}, "(its image_processor): field 'do_pad' = True is not supported"),
        ({"image_processor": None}, "preprocessor_config.json: No such file or directory"),
    ],
)
def test_processor_config_is_read_as_transformers_reads_it(
    sources: Path, tmp_path: Path, capsys: pytest.CaptureFixture, change: dict, message: str
) -> None:
    """The image processor nested in processor_config.json is followed, its fields checked; without it,
    preprocessor_config.json is read (here: there is none)."""
    source = _copy(sources, "st6-clip", tmp_path)
    processor = source / PROCESSOR_CONFIG
    settings = json.loads(processor.read_text())
    nested = change.get("image_processor", settings["image_processor"])
    _rewrite(processor, change | {"image_processor": nested and settings["image_processor"] | nested})
    error = _refusal(source, tmp_path, capsys)
    assert message in error


def _save_sentencepiece_tokenizer(folder: Path) -> None:
    """SigLIP's tokenizer as google/siglip-* ship it: spiece.model, read by transformers' SiglipTokenizer."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(training_sentences()),
        model_writer=model,
        vocab_size=120,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    (folder / "spiece.model").write_bytes(model.getvalue())
    declared = {"tokenizer_class": "SiglipTokenizer", "model_max_length": MAX_POSITIONS}
    (folder / "tokenizer_config.json").write_text(json.dumps(declared))


def test_a_tokenizer_without_a_tokenizers_pipeline_is_refused(
    sources: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """SiglipTokenizer (sentencepiece, then its own Python clean-up) cannot be served: one line says why."""
    source = _copy(sources, "siglip", tmp_path)
    (source / "tokenizer.json").unlink()
    _save_sentencepiece_tokenizer(source)
    error = _refusal(source, tmp_path, capsys)
    assert "no tokenizer.json, and transformers' SiglipTokenizer tokenises in Python" in error


def test_a_folder_without_tokenizer_files_is_exported_for_token_input(sources: Path, tmp_path: Path) -> None:
    """No vocabulary at all: nothing to convert, the text tower is gated on random ids and takes token ids."""
    source = _copy(sources, "clip", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (source / name).unlink()
    status = export_main(["--source", str(source), "--repository", str(tmp_path / "repository"), "--threads", "1"])
    assert status == 0
    parity = json.loads((tmp_path / "repository" / "clip" / "parity.json").read_text())
    assert parity["towers"]["text"]["inputs"][0].startswith("random ids")
    assert not (tmp_path / "repository" / "clip" / "tokenizer.json").exists()
