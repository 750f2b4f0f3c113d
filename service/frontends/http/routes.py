"""The HTTP port's routes as one table: path, handlers by method, error dialect, traced, open without a key.

The application (app.py) registers its routes here once; what was several lists (the traced routes,
the open ones, which routes answer in which error body) is read from each route's row.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from service.frontends.http.errors import Dialect

UNMATCHED = "unmatched"
"""The template (a metric label) of a path no route serves."""
_PARAMETER = re.compile(r"\{(\w+)\}")

Handler = Callable[[Any], Awaitable[Any]]
"""A route's handler for one method: a call in, its response out (app.py's Call and Response)."""


@dataclass(frozen=True)
class Route:
    """One route: where it is, what answers it, and how the envelope treats it."""

    template: str
    """Its path, with {parameters} where it has any: also its label in encoder_http_requests_total."""
    handlers: Mapping[str, Handler]
    """Its handler for each method it answers."""
    dialect: Dialect
    """The error body it answers in (errors.py)."""
    traced: bool = False
    """Its requests get a trace span while tracing is on (the inferences)."""
    open: bool = False
    """It needs no API key and is never refused for load (the probes', as grpc.health.v1 on the gRPC port)."""
    pattern: str | None = None
    """The regular expression its paths match, where the template alone does not say it (optional parts);
    by default the template, each {parameter} one path segment."""
    _compiled: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.pattern is not None or "{" in self.template:
            source = self.pattern or _PARAMETER.sub(r"(?P<\1>[^/]+)", self.template)
            object.__setattr__(self, "_compiled", re.compile(source))

    @property
    def fixed(self) -> bool:
        """Whether it serves one path, its template, and has no parameters."""
        return self._compiled is None

    def match(self, path: str) -> dict[str, str] | None:
        """The path's parameters if this route serves it (a parameter left out is ""), else None."""
        if self._compiled is None:
            return {} if path == self.template else None
        found = self._compiled.fullmatch(path)
        return None if found is None else {name: value or "" for name, value in found.groupdict().items()}


class RouteTable:
    """The routes of the port: a path to its route and parameters (fixed paths first, then the others in order)."""

    def __init__(self, routes: tuple[Route, ...]) -> None:
        self.routes = routes
        fixed = [route for route in routes if route.fixed]
        self._fixed = {route.template: route for route in fixed}
        self._patterned = [route for route in routes if not route.fixed]
        if len(self._fixed) != len(fixed):
            raise ValueError("two routes have the same path")

    def match(self, path: str) -> tuple[Route, dict[str, str]]:
        """The route serving `path` and its parameters; for no route, an unmatched one without handlers.

        A path no route serves answers in OpenAI's error body under /v1/ (that family's clients), else KServe's.
        """
        route = self._fixed.get(path)
        if route is not None:
            return route, {}
        for route in self._patterned:
            params = route.match(path)
            if params is not None:
                return route, params
        return Route(UNMATCHED, {}, Dialect.OPENAI if path.startswith("/v1/") else Dialect.KSERVE), {}
