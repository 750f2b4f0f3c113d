"""gRPC's wire format as the Envoy front end reads and writes it (service.frontends.grpc.framing)."""

from __future__ import annotations

import gzip
import zlib

import pytest

from service.frontends.grpc import framing


def test_messages_split_across_chunks_come_out_whole_and_in_order() -> None:
    body = b"".join(framing.frame(message) for message in (b"first", b"", b"x" * 70_000))
    reader = framing.MessageReader("identity", 100_000)
    messages = [message for start in range(0, len(body), 7) for message in reader.feed(body[start : start + 7])]
    reader.finish()
    assert messages == [b"first", b"", b"x" * 70_000]


def test_a_body_ending_inside_a_message_is_refused() -> None:
    reader = framing.MessageReader("identity", 100)
    assert list(reader.feed(framing.frame(b"whole")[:-2])) == []
    with pytest.raises(framing.FramingError, match="ended inside a message"):
        reader.finish()


def test_the_size_limit_holds_before_the_message_arrives() -> None:
    reader = framing.MessageReader("identity", 10)
    with pytest.raises(framing.MessageTooLarge, match=r"Received message larger than max \(11 vs\. 10\)"):
        list(reader.feed(framing.frame(b"x" * 11)[:5]))  # the prefix alone is enough


@pytest.mark.parametrize(
    ("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)], ids=["gzip", "deflate"]
)
def test_compressed_messages_are_read(encoding: str, compress) -> None:
    packed = compress(b"hello " * 100)
    flagged = b"\1" + len(packed).to_bytes(4, "big") + packed
    reader = framing.MessageReader(encoding, 1000)
    assert list(reader.feed(flagged + framing.frame(b"plain"))) == [b"hello " * 100, b"plain"]


def test_a_small_message_that_expands_past_the_limit_is_refused_without_expanding_it_all() -> None:
    packed = gzip.compress(b"\0" * 50_000_000)  # about 50 kB that would be 50 MB
    flagged = b"\1" + len(packed).to_bytes(4, "big") + packed
    with pytest.raises(framing.MessageTooLarge, match=r"larger than max \(1000001 vs\. 1000000\)"):
        list(framing.MessageReader("gzip", 1_000_000).feed(flagged))


def test_unknown_codecs_and_undecodable_messages_are_refused() -> None:
    with pytest.raises(framing.FramingError, match="grpc-encoding 'snappy' is not supported"):
        framing.MessageReader("snappy", 10)
    flagged = b"\1" + (4).to_bytes(4, "big") + b"junk"
    with pytest.raises(framing.FramingError, match="does not decompress"):
        list(framing.MessageReader("gzip", 100).feed(flagged))
    with pytest.raises(framing.FramingError, match="grpc-encoding is identity"):
        list(framing.MessageReader("identity", 100).feed(flagged))


@pytest.mark.parametrize(
    ("header", "seconds"), [("100m", 0.1), ("5S", 5.0), ("2M", 120.0), ("1H", 3600.0), ("250u", 250e-6), ("7n", 7e-9)]
)
def test_grpc_timeout_units(header: str, seconds: float) -> None:
    assert framing.timeout_s(header) == pytest.approx(seconds)


@pytest.mark.parametrize("header", ["", "S", "10", "10s", "-1S", "123456789S"])
def test_malformed_grpc_timeouts_are_refused(header: str) -> None:
    with pytest.raises(framing.FramingError, match="is not a timeout"):
        framing.timeout_s(header)


def test_status_messages_survive_percent_encoding() -> None:
    text = "unknown model 'naïve 100%' \u2014 see docs\nline two"
    encoded = framing.status_message(text)
    assert encoded.isascii() and b"\n" not in encoded
    assert framing.read_status_message(encoded) == text


def test_binary_metadata_is_base64_both_ways() -> None:
    raw = bytes(range(256))
    assert framing.metadata_value("trace-bin", framing.base64_value(raw)) == raw
    assert framing.metadata_value("authorization", b"Bearer k") == "Bearer k"
