"""LoRA adapters over HTTP, in vLLM's shapes: POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}, answered with vLLM's
plain-text "Success: ..." lines. They change what the server serves, so they are off (404 naming
the flags) unless the server runs with --enable-lora and --allow-runtime-lora-updating.

Which adapters are served and how a request names one (its `model`) is ServerState's
(server/app.py): /v1/models lists each adapter with `parent` set to the base model.
"""
from __future__ import annotations

import asyncio
import json

from quart import Response, request

from engine.lora.adapter import LoraError
from server.protocol import APIError

RUNTIME_FLAGS = "--enable-lora and --allow-runtime-lora-updating"


def register_lora(app, state) -> None:
    """Adds the two routes to `app`, served from `state` (server/app.py's ServerState)."""

    async def body_and_manager() -> tuple[dict, object]:
        if not state.settings.lora_runtime_updates:
            raise APIError(f"Loading and unloading LoRA adapters at run time is off: start the "
                           f"server with {RUNTIME_FLAGS}", status=404, type="not_found_error",
                           code="lora_updates_off")
        engine = state.ready_engine()
        try:
            body = json.loads(await request.get_data())
        except ValueError as e:
            raise APIError(f"The body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError("The body must be a JSON object", code="invalid_value")
        return body, engine.lora

    def name_in(body: dict, field: str, message: str) -> str:
        value = body.get(field)
        if not isinstance(value, str) or not value.strip():
            raise APIError(message, param=field, code="invalid_value")
        return value

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter():
        body, manager = await body_and_manager()
        message = "Both 'lora_name' and 'lora_path' must be provided."
        name, path = name_in(body, "lora_name", message), name_in(body, "lora_path", message)
        if name in state.settings.served_model_names:
            raise APIError(f"'{name}' is the base model's name; give the adapter another",
                           param="lora_name", code="invalid_value")
        if any(a.name == name for a in manager.adapters()):
            raise APIError(f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name", code="invalid_value")
        try:          # reading and checking the files takes a while: off the event loop
            await asyncio.to_thread(manager.load, name, path)
        except LoraError as e:
            raise APIError(str(e), param="lora_path", code="invalid_value") from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status=200,
                        content_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter():
        body, manager = await body_and_manager()
        name = name_in(body, "lora_name",
                       "'lora_name' needs to be provided to unload a LoRA adapter.")
        try:
            manager.unload(name)
        except KeyError:
            raise APIError(f"The lora adapter '{name}' cannot be found.", status=404,
                           type="not_found_error", param="lora_name",
                           code="lora_not_found") from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status=200,
                        content_type="text/plain")
