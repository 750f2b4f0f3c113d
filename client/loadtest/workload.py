"""The requests a run sends, built once up front so sending costs the generator little CPU."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from client.loadtest.config import ConfigError, LoadConfig
from client.loadtest.corpus import load_corpus
from client.protocol import text_request, token_request
from service.proto import grpc_service_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRequest:
    """One ready-to-send ModelInferRequest, the corpus it came from and how many sequences it carries."""

    message: pb.ModelInferRequest
    kind: str
    sequences: int


@dataclass(frozen=True)
class Workload:
    """A fixed pool of prepared requests; runs cycle through it."""

    requests: tuple[PreparedRequest, ...]

    @property
    def inputs(self) -> dict[str, str]:
        """Input name -> datatype that every request sends."""
        return {tensor.name: tensor.datatype for tensor in self.requests[0].message.inputs}

    @property
    def outputs(self) -> tuple[str, ...]:
        """Outputs every request asks for."""
        return tuple(output.name for output in self.requests[0].message.outputs)

    @classmethod
    def build(cls, config: LoadConfig) -> Workload:
        """`config.pool_size` requests of `config.batch_size` texts, each request's kind drawn from the mix."""
        rng = random.Random(config.seed)
        kinds = list(config.mix)
        weights = [config.mix[kind] for kind in kinds]
        tokenizer = _load_tokenizer(config.tokenizer_path, config.max_length) if config.input_kind == "tokens" else None
        requests = []
        for kind in rng.choices(kinds, weights, k=config.pool_size):
            texts = rng.choices(load_corpus(kind), k=config.batch_size)
            if tokenizer is None:
                message = text_request(config.model, texts)
            else:
                encodings = tokenizer.encode_batch(texts)
                input_ids = np.array([encoding.ids for encoding in encodings], dtype=np.int64)
                attention_mask = np.array([encoding.attention_mask for encoding in encodings], dtype=np.int64)
                message = token_request(config.model, input_ids, attention_mask)
            requests.append(PreparedRequest(message, kind, len(texts)))
        logger.debug("built %d requests of %d sequences", len(requests), config.batch_size)
        return cls(tuple(requests))


def _load_tokenizer(path: Path | None, max_length: int) -> Tokenizer:
    """The tokenizer truncating at max_length and padding to the longest text of a request.

    The file's own truncation and padding (often fixed padding to 128) are replaced.
    """
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the tokenizers library raises plain Exception on a bad file
        raise ConfigError(f"cannot read tokenizer {path}: {' '.join(str(error).split())}") from error
    padding = tokenizer.padding or {}
    pad_token = padding.get("pad_token", "[PAD]")
    pad_id = padding.get("pad_id", tokenizer.token_to_id(pad_token) or 0)
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token)
    return tokenizer
