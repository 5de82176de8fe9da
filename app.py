"""Launch only: parse settings, refuse an open host without AUTH, load the model, build the UI (ui.build_demo),
mount the OpenAI-compatible API at /v1, serve. `python app.py --help` lists every flag."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from typing import Any

import gradio as gr
from starlette.routing import Mount

from llm_core.config import SPECS, Settings, parse_auth
from llm_core.engine.backend import ChatBackend
from llm_core.engine.chat import ChatEngine
from llm_core.engine.compare import EnginePool
from llm_core.engine.remote import RemoteEngine
from llm_core.errors import LLMCoreError, SettingsError
from llm_core.security import check_exposure
from llm_core.web.errors import api_error as _api_error  # the names launch() uses
from llm_core.web.openai_api import create_openai_app
from ui import build_demo
from ui.common import WORKER_THREADS as _WORKER_THREADS

log = logging.getLogger("llm_demo")


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line flags: one per setting (--model-id, --quantization, …), all optional, unknown flags fail."""
    parser = argparse.ArgumentParser(description="Local LLM demo: 4-bit chat with per-reply cost numbers.")
    parser.add_argument("--env-file", default=".env", help="dotenv file with settings (default: .env)")
    for spec in SPECS:
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if spec.is_switch else {}
        parser.add_argument(spec.flag, dest=spec.name, default=None, help=spec.help, **extra)
    return vars(parser.parse_args(argv))


def launch(demo: gr.Blocks, settings: Settings, pool: EnginePool | None = None, **options: Any) -> Any:
    """Serve the demo as settings say: AUTH -> parse_auth -> Gradio's login, with failed logins and API keys
    throttled per user and per address, sessions kept to their owners on every route, other sites' browser requests
    refused, unused routes closed, clean errors for malformed payloads (llm_core.web.guard); X-Forwarded-For believed
    only from FORWARDED_ALLOW_IPS; with `pool`, the OpenAI-compatible API under /v1 on the same server, on the
    engine that serves the chat tab (llm_core.web.openai_api); MCP_SERVER. `options` go to gr.Blocks.launch
    (tests: prevent_thread_lock, quiet)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.middleware import Middleware

    from llm_core.security import LoginThrottle, SessionOwners
    from llm_core.web.guard import GuardMiddleware, validation_error_handler

    server = settings.server
    logins = parse_auth(server.auth) if server.auth else None
    throttle = LoginThrottle(server.login_max_failures, server.login_window_s,
                             users=[user for user, _ in logins or []])
    guard = Middleware(GuardMiddleware, throttle=throttle, owners=SessionOwners(), server=server)
    check_mcp_support(settings)
    app_kwargs: dict[str, Any] = {"middleware": [guard],
                                  "exception_handlers": {RequestValidationError: validation_error_handler}}
    if pool is not None:
        app_kwargs["routes"] = [Mount("/v1", app=create_openai_app(pool.primary, settings, _api_error,
                                                                   throttle=throttle))]
    # Gradio builds uvicorn's Config itself without forwarded_allow_ips, so uvicorn reads this variable, else
    # trusts X-Forwarded-For from 127.0.0.1 (every SHARE user arrives from there). Set only while the Config is built.
    previous = os.environ.get("FORWARDED_ALLOW_IPS")
    os.environ["FORWARDED_ALLOW_IPS"] = ",".join(server.forwarded_allow_ips)
    try:
        return demo.launch(server_name=server.host, server_port=server.port, share=server.share, auth=logins,
                           show_error=True, max_threads=_WORKER_THREADS, app_kwargs=app_kwargs,
                           mcp_server=server.mcp_server, **options)
    finally:
        if previous is None:
            os.environ.pop("FORWARDED_ALLOW_IPS", None)
        else:
            os.environ["FORWARDED_ALLOW_IPS"] = previous


def start(argv: list[str] | None = None, **launch_options: Any) -> gr.Blocks:
    """Parse settings, refuse an open host without AUTH (before loading anything), load, build and launch without
    blocking. Raises LLMCoreError (SettingsError, ModelLoadError) with a message for the operator."""
    args = parse_args(argv)
    env_file = args.pop("env_file")
    settings = Settings.from_env(env_file=env_file, overrides=args)
    warning = check_exposure(settings.server)
    if warning:
        log.warning(warning)
    check_mcp_support(settings)
    engine: ChatBackend = (RemoteEngine.connect(settings, progress=log.info) if settings.remote.engine == "openai"
                           else ChatEngine.load(settings, progress=log.info))
    log.info("Load report: %s", json.dumps(engine.report.as_dict()))
    pool = EnginePool(settings, primary=engine)
    demo = build_demo(engine, settings, pool)
    launch(demo, settings, pool, prevent_thread_lock=True, **launch_options)
    return demo


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        demo = start(argv)
    except LLMCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    demo.block_thread()
    return 0


def check_mcp_support(settings: Settings) -> None:
    """MCP_SERVER=true needs Gradio's MCP extra; say so before the model loads, not after."""
    if settings.server.mcp_server and importlib.util.find_spec("mcp") is None:
        raise SettingsError('MCP_SERVER=true needs Gradio\'s MCP support: pip install "gradio[mcp]==6.31.0", or set '
                            "MCP_SERVER=false.")


if __name__ == "__main__":
    sys.exit(main())
