"""LoRA adapters over HTTP: /v1/models entries (with `parent`), and
POST /v1/load_lora_adapter / /v1/unload_lora_adapter (vLLM's routes; behind
the API key like every non-public path). The registry is the replica's
frontend's (conveyor.engine.frontend.prepare.LoRARegistry): a load reaches the replica that
served it; workers read the adapter from its path when a request first uses it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from conveyor.cluster.openai import errors as E


def _registry(loras: Any) -> Any:
    if loras is None:
        raise E.bad_request("LoRA is not enabled on this server (lora.enable)", "lora_name")
    return loras


def load(loras: Any, body: dict[str, Any]) -> dict[str, Any]:
    """{"lora_name", "lora_path"}: 400 naming what is wrong with either."""
    reg = _registry(loras)
    name, path = body.get("lora_name"), body.get("lora_path")
    for key, v in (("lora_name", name), ("lora_path", path)):
        if not isinstance(v, str) or not v:
            raise E.bad_request(f"{key} must be a non-empty string", key)
    try:
        reg.add(name, path)
    except ValueError as e:
        param = "lora_name" if str(e).startswith("lora_name") else "lora_path"
        raise E.bad_request(str(e), param) from None
    return {"status": "ok", "lora_name": name}


def unload(loras: Any, body: dict[str, Any]) -> dict[str, Any]:
    reg = _registry(loras)
    name = body.get("lora_name")
    try:
        reg.remove(name if isinstance(name, str) else "")
    except KeyError:
        raise E.APIError(404, f"The LoRA adapter `{name}` is not loaded.", code="model_not_found",
                         param="lora_name") from None
    return {"status": "ok", "lora_name": name}


def add_routes(app: FastAPI, loras: Callable[[], Any], guarded: Callable[[Any], Any],
               responses: dict[int | str, dict[str, Any]]) -> None:
    async def run(fn: Callable[[Any, dict[str, Any]], dict[str, Any]], body: dict[str, Any]) -> Response:
        return JSONResponse(fn(loras(), body))

    @app.post("/v1/load_lora_adapter", responses=responses)
    async def load_lora_adapter(body: dict[str, Any]) -> Response:
        return await guarded(run(load, body))

    @app.post("/v1/unload_lora_adapter", responses=responses)
    async def unload_lora_adapter(body: dict[str, Any]) -> Response:
        return await guarded(run(unload, body))
