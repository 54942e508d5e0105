"""The HTTP side of the playground: an OpenAI-compatible API with Prometheus metrics and per-client rate
limits over one engine, served by uvicorn, optionally with a Gradio app mounted at ``/``.

Modules: :mod:`server.protocol` (request bodies, errors, checks), :mod:`server.metrics` (Prometheus),
:mod:`server.ratelimit` (per-client limit), :mod:`server.openai_api` (routes, :func:`create_api`),
:mod:`server.app` (:func:`build_server`), :mod:`server.serving` (:func:`serve`, :class:`ServerThread`: uvicorn,
without the engine), :mod:`server.options`
(command-line options). Nothing here imports ``ui``.

The exports below are loaded on first use, so that ``server.options`` (parsing a command line) does not
import the engine, FastAPI or uvicorn.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.app import build_server
    from server.openai_api import create_api
    from server.serving import ServerThread, serve

__all__ = ["ServerThread", "build_server", "create_api", "serve"]

_WHERE = {"ServerThread": "server.serving", "build_server": "server.app", "serve": "server.serving",
          "create_api": "server.openai_api"}


def __getattr__(name: str):
    """``server.build_server`` etc.: imported from their module on first use."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'server' has no attribute {name!r}")
