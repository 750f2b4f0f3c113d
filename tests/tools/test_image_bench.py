"""The image bench's pieces on the tests' tiny CLIP export, against a real server (figures are never asserted)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import transformers
from PIL import Image

from tests.export.two_tower_folders import exported_two_towers
from tools.image_bench import TABLE_HEADER, Ceiling, measure, photo_jpeg, table_row, vit_b_32_config

MODEL = "clip"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared tiny CLIP export alone (tests.export.two_tower_folders)."""
    folder = tmp_path_factory.mktemp("image-bench")
    (folder / MODEL).symlink_to(exported_two_towers() / "repository" / MODEL)
    return folder


def test_the_test_image_is_a_jpeg_of_the_size_asked() -> None:
    with Image.open(io.BytesIO(photo_jpeg(64, 48))) as image:
        assert (image.format, image.size, image.mode) == ("JPEG", (64, 48), "RGB")


def test_the_full_size_config_is_vit_b_32_with_the_tiny_tokenizers_text_settings() -> None:
    tiny_folder = exported_two_towers() / "source" / MODEL
    config = vit_b_32_config(tiny_folder)
    vision, text = config.vision_config, config.text_config
    assert (vision.image_size, vision.patch_size, vision.hidden_size, vision.num_hidden_layers) == (224, 32, 768, 12)
    assert (text.hidden_size, text.num_hidden_layers, config.projection_dim) == (512, 12, 512)
    tiny_text = transformers.CLIPConfig.from_pretrained(str(tiny_folder)).text_config
    assert (text.vocab_size, text.eos_token_id, text.pad_token_id) == (
        tiny_text.vocab_size,
        tiny_text.eos_token_id,
        tiny_text.pad_token_id,
    )


def test_the_ceiling_preprocesses_and_runs_the_image_tower(repository: Path) -> None:
    ceiling = Ceiling(repository / MODEL, threads=1, workers=2)
    try:
        image = photo_jpeg(64, 48)
        assert ceiling.images_per_s(image, batch=3, seconds=0.2) > 0
        assert ceiling.graph_images_per_s(image, batch=3, seconds=0.2) > 0
        assert ceiling.preprocess_cpu_ms(image, images=3) > 0
    finally:
        ceiling.close()


@pytest.mark.usefixtures("h2load_installed")
def test_one_round_measures_the_server_and_the_model_in_process(repository: Path) -> None:
    result = measure(repository, MODEL, photo_jpeg(96, 64), threads=1, workers=1, in_flight=2, seconds=0.5)
    # Every figure comes from something that ran: the server's own counters, h2load's log, /proc, this process.
    assert result.served_images_per_s > 0 and result.ceiling_images_per_s > 0 and result.graph_images_per_s > 0
    assert 1 <= result.rows_per_run <= 2
    assert result.served_p50_ms > 0 and result.preprocess_cpu_ms > 0 and result.server_cpu_ms > 0
    assert result.image.startswith("96x64 JPEG, ")
    columns = TABLE_HEADER.splitlines()[0].count("|")
    assert table_row(1, result).startswith("| 1 | ") and table_row(1, result).count("|") == columns
