"""The HTTP port's route table: a path to its route and parameters; each route's error dialect, tracing, key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.envelope import Envelope
from service.errors import InvalidArgument, Overloaded, Unauthenticated
from service.frontends.http.app import HttpApp
from service.frontends.http.errors import Dialect, error_answer
from service.frontends.http.routes import UNMATCHED, Route, RouteTable
from service.ops.settings import Settings
from service.pipeline.api import Pipeline

TEI_TASKS = ("/embed", "/embed_all", "/embed_sparse", "/similarity", "/rerank", "/predict", "/tokenize", "/decode")


@pytest.fixture(scope="module")
def table() -> RouteTable:
    """The table of an application over a pipeline serving nothing (routing needs no model)."""
    door = Envelope(Pipeline(Settings(model_repository=Path("unused"))), api_keys=None)
    return HttpApp(door, max_body_bytes=1024, max_embedding_inputs=8, max_concurrent_requests=4).routes


@pytest.mark.parametrize(
    ("path", "template", "params"),
    [
        ("/v1/embeddings", "/v1/embeddings", {}),
        ("/v1/models/tiny", "/v1/models/{name}", {"name": "tiny"}),
        ("/v2/models/stats", "/v2/models/stats", {}),  # a fixed path before the model pattern it also fits
        ("/v2/models/tiny", "/v2/models/{name}", {"name": "tiny", "version": ""}),
        ("/v2/models/tiny/versions/2/infer", "/v2/models/{name}/infer", {"name": "tiny", "version": "2"}),
        ("/v2/models/tiny/ready", "/v2/models/{name}/ready", {"name": "tiny", "version": ""}),
        ("/v2/cudasharedmemory/region/r0/status", "/v2/cudasharedmemory/status", {}),
        ("/v2/models/tiny/trace/setting", "/v2/trace/setting", {}),
        ("/v2/models/tiny/explain", UNMATCHED, {}),
    ],
)
def test_a_path_finds_its_route_and_parameters(table: RouteTable, path: str, template: str, params: dict) -> None:
    route, found = table.match(path)
    assert (route.template, found) == (template, params)


def test_each_route_answers_errors_in_its_familys_body(table: RouteTable) -> None:
    dialects = {route.template: route.dialect for route in table.routes}
    assert dialects["/v1/embeddings"] is dialects["/v1/models/{name}"] is Dialect.OPENAI
    assert dialects["/v1/rerank"] is dialects["/v2/embed"] is Dialect.COHERE
    assert {dialects[path] for path in (*TEI_TASKS, "/info")} == {Dialect.TEI}
    assert dialects["/v2/models/{name}/infer"] is dialects["/v2/health/ready"] is Dialect.KSERVE
    assert table.match("/v1/nowhere")[0].dialect is Dialect.OPENAI  # a path no route serves: by its family's prefix
    assert table.match("/nowhere")[0].dialect is Dialect.KSERVE


def test_the_inferences_are_traced_and_only_the_probes_are_open(table: RouteTable) -> None:
    traced = {route.template for route in table.routes if route.traced}
    assert traced == {
        "/v1/embeddings",
        "/v1/rerank",
        "/v2/embed",
        "/v2/models/{name}/infer",
        *(path for path in TEI_TASKS if path not in ("/tokenize", "/decode")),
    }
    assert {route.template for route in table.routes if route.open} == {"/v2/health/live", "/v2/health/ready"}


def test_two_routes_of_one_path_are_refused() -> None:
    with pytest.raises(ValueError, match="same path"):
        RouteTable((Route("/a", {}, Dialect.KSERVE), Route("/a", {}, Dialect.TEI)))


def test_the_dialects_bodies_and_statuses() -> None:
    wrong = InvalidArgument("top_n must be a positive integer")
    assert error_answer(Dialect.COHERE, wrong) == (400, {"message": "top_n must be a positive integer"})
    assert error_answer(Dialect.TEI, wrong) == (422, {"error": str(wrong), "error_type": "Validation"})
    assert error_answer(Dialect.KSERVE, wrong) == (400, {"error": str(wrong)})
    full = Overloaded("queue full", "queue_full")
    openai_body = {"error": {"message": "queue full", "type": "rate_limit_error", "param": None, "code": "queue_full"}}
    assert error_answer(Dialect.OPENAI, full) == (429, openai_body)
    assert error_answer(Dialect.COHERE, Unauthenticated("missing or unknown API key")) == (
        401,
        {"message": "missing or unknown API key"},
    )


def test_the_api_document_gives_each_route_its_error_body(table: RouteTable) -> None:
    """docs/api.md's table of routes names each route of the table, with its family's error body."""
    families = {
        "OpenAI": Dialect.OPENAI,
        "Cohere (and Jina's rerank)": Dialect.COHERE,
        "text-embeddings-inference": Dialect.TEI,
        "KServe v2 REST": Dialect.KSERVE,
    }
    documented = {}
    for line in (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[1] in families:
            documented |= dict.fromkeys(re.findall(r"`(/[^`]*)`", cells[0]), families[cells[1]])
    served = {route.template: route.dialect for route in table.routes if route.template in documented}
    assert served == documented  # every documented route is served, in the documented body
    assert {route.template for route in table.routes if not route.pattern} <= set(documented)
