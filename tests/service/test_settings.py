"""Settings from flags and ENCODER_* variables, validated once."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.ops import settings as settings_module
from service.ops.settings import Settings, SettingsError, load_settings


def test_defaults_match_the_external_contract() -> None:
    settings = load_settings([], environ={})
    assert (settings.grpc_port, settings.metrics_port) == (8001, 8002)
    assert settings.model_repository == Path("model_repository")
    assert settings.device == "auto" and not settings.require_gpu


def test_flags_beat_environment_which_beats_defaults() -> None:
    environ = {"ENCODER_GRPC_PORT": "9001", "ENCODER_METRICS_PORT": "9002", "ENCODER_REQUIRE_GPU": "true"}
    settings = load_settings(["--grpc-port", "7001", "--no-require-gpu"], environ=environ)
    assert settings.grpc_port == 7001
    assert settings.metrics_port == 9002
    assert settings.require_gpu is False
    assert load_settings([], environ=environ).require_gpu is True


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--grpc-port", "70000"], {}, "grpc_port must be 0-65535"),
        (["--grpc-port", "eighty"], {}, "grpc_port must be int"),
        (["--device", "tpu"], {}, "device must be one of auto, cpu"),
        ([], {"ENCODER_INSTANCES": "0"}, "instances must be at least 1"),
        ([], {"ENCODER_WARMUP": "maybe"}, "ENCODER_WARMUP must be a boolean"),
        (["--max-queue-delay-us", "-5"], {}, "max_queue_delay_us must be >= 0"),
        (["--drain-timeout-s", "-1"], {}, "drain_timeout_s must be >= 0"),
        (["--drain-timeout-s", "nan"], {}, "drain_timeout_s must be a finite number, got nan"),
        ([], {"ENCODER_MAX_BATCH_RUN_S": "inf"}, "max_batch_run_s must be a finite number, got inf"),
        ([], {"ENCODER_MAX_CONNECTION_AGE_S": "-Infinity"}, "max_connection_age_s must be a finite number"),
        (["--max-connection-age-s", "2200000"], {}, "max_connection_age_s must be at most 2000000"),
        ([], {"ENCODER_MAX_IMAGE_BYTES": "0"}, "max_image_bytes must be at least 1"),
        (["--max-image-pixels", "100000000"], {}, r"max_image_pixels must be at most 89478485 \(Pillow's own"),
    ],
)
def test_bad_settings_name_the_setting(argv: list[str], environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(argv, environ=environ)


def test_threads_split_available_cpus_across_instances() -> None:
    assert Settings(intra_op_threads=3).resolved_intra_op_threads() == 3
    assert Settings(instances=64).resolved_intra_op_threads() == 1


@pytest.mark.parametrize(
    ("cpus", "on_cuda", "frontends"),
    [(2, False, 1), (8, False, 1), (16, False, 2), (64, False, 8), (2, True, 1), (4, True, 3), (16, True, 15)],
)
def test_automatic_front_ends_follow_the_cpus_and_where_the_model_runs(
    monkeypatch: pytest.MonkeyPatch, cpus: int, on_cuda: bool, frontends: int
) -> None:
    monkeypatch.setattr(settings_module, "available_cpus", lambda: cpus)
    assert Settings().resolved_frontends(on_cuda) == frontends
    assert Settings(frontends=5).resolved_frontends(on_cuda) == 5


def test_front_ends_leave_the_model_the_other_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_module, "available_cpus", lambda: 16)
    assert Settings(frontends=4).resolved_intra_op_threads() == 12
    assert Settings(frontends=4, instances=2).resolved_intra_op_threads() == 6
    assert Settings(frontends=1).resolved_intra_op_threads() == 16  # one process: the model has every CPU
