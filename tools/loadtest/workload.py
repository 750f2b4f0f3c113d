"""The requests a run sends, built once up front so sending costs the generator little CPU."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from client.protocol import text_request, token_request
from protocol import grpc_service_pb2 as pb
from service.pipeline.tokenizer import TextTokenizer
from tools.loadtest.config import ConfigError, LoadConfig
from tools.loadtest.corpus import load_corpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRequest:
    """One ready-to-send ModelInferRequest, the corpus it came from and the texts it carries."""

    message: pb.ModelInferRequest
    kind: str
    texts: tuple[str, ...]

    @property
    def sequences(self) -> int:
        """Texts (sequences) in the request."""
        return len(self.texts)


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
                tokens = tokenizer.encode(texts)
                message = token_request(config.model, tokens.input_ids, tokens.attention_mask)
            requests.append(PreparedRequest(message, kind, tuple(texts)))
        logger.debug("built %d requests of %d sequences", len(requests), config.batch_size)
        return cls(tuple(requests))


def _load_tokenizer(path: Path | None, max_length: int) -> TextTokenizer:
    """The server's own tokenizer setup: truncation at max_length, padding to the longest text.

    The file's own truncation and padding (often fixed padding to 128) are replaced.
    """
    try:
        return TextTokenizer(path, max_length)
    except Exception as error:  # the tokenizers library raises plain Exception on a bad file
        raise ConfigError(f"cannot read tokenizer {path}: {' '.join(str(error).split())}") from error
