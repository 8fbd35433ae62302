"""``kvserve serve``: the OpenAI-compatible server, with every engine option as a flag."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from kvserve.options import add_engine_args, engine_config, engine_options

if TYPE_CHECKING:
    from kvserve.server.serving import ServerSettings

API_KEY_ENV = "KVSERVE_API_KEY"


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}; "
                        "unset or empty = no authentication)")
    g.add_argument("--tenant-keys", default=None, metavar="FILE",
                   help="a file of 'TENANT KEY' lines: each key authenticates its tenant, whose requests share "
                        "cached KV only with each other (docs/server.md \"Tenants\")")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model's name)")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body accepted; larger ones get 413 (default 1 MiB)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs each request)")
    add_engine_args(s)
    s.set_defaults(run=run_serve)
    return s


def resolve_api_key(flag: str | None) -> str | None:
    """The key to require: the flag's, else the environment's; empty means none (no
    authentication), so ``--api-key ""`` also turns off a key set in the environment."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    return key or None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.engine.engine import LLMEngine
    from kvserve.server.app import create_app

    engine = LLMEngine(engine_config(args.model, **serve_engine_options(args)))
    app = create_app(engine, server_settings(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


def serve_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags' options, as a server runs them: an engine whose KV cache cannot hold one
    request of its context window refuses to start unless ``--max-model-len-fit`` says otherwise
    (a chat request without max_tokens asks for the whole window)."""
    options = engine_options(args)
    options.setdefault("max_model_len_fit", "refuse")
    return options


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The HTTP settings of the server flags (also the cluster ingress's)."""
    from kvserve.model.loader import default_model_name
    from kvserve.server.serving import ServerSettings

    return ServerSettings(model_name=args.served_model_name or default_model_name(args.model),
                          api_key=resolve_api_key(args.api_key), max_body_bytes=args.max_request_bytes,
                          tenant_keys=read_tenant_keys(args.tenant_keys) if args.tenant_keys else {})


def read_tenant_keys(path: str) -> dict[str, str]:
    """Key -> tenant from a file of ``TENANT KEY`` lines (blank lines and ``#`` comments skipped);
    ValueError naming the line that is not two fields or repeats a key."""
    keys: dict[str, str] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) != 2 or fields[1] in keys:
                raise ValueError(f"{path}:{number}: want 'TENANT KEY' with a key used once")
            keys[fields[1]] = fields[0]
    return keys
