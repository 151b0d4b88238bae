"""Structured outputs on the wire: the request's one constraint, read from OpenAI's
`response_format` (the Responses API's `text.format`, the same formats with the json_schema's
fields beside its type), vLLM's `structured_outputs` object or vLLM's older `guided_*` fields, and
compiled on the engine's grammar pool before the request enters the engine.

Every problem is a 400 naming the parameter: two constraints in one request, a malformed field,
an invalid JSON schema, regex or grammar, a schema keyword the grammar library cannot enforce, or
a grammar over the library's limits (met while compiling, or while generating: then the request
fails with a 400 naming the parameter, or an error event if its stream has started; never with
unconstrained text). Compiling runs off the event loop with a timeout
(--structured-outputs-timeout) on the engine's grammar threads, each compile bounded by the
library's limits (engine/sampling/structured_outputs.py); a grammar that fails only fails its
own request.
"""
from __future__ import annotations

import asyncio
import json
import re

from engine.sampling.structured_outputs import StructuredOutputsParams, json_spec
from server.protocol import APIError

# vLLM's structured_outputs keys this server enforces, and its older top-level fields.
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _invalid(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param, code="invalid_value")


def request_constraint(req) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the parameter it came from; None for free text."""
    found: list[tuple[str, str, object]] = []       # (param, kind, value)
    fmt = req.response_format
    if fmt is not None:
        found += _response_format(fmt)
    text_format = getattr(req, "text_format", lambda: None)()      # the Responses API's
    if text_format is not None:
        found += _response_format(text_format, "text.format", flat=True)
    so = req.structured_outputs
    if so is not None:
        for key, value in so.items():
            if key not in _SO_KINDS:
                raise APIError(f"structured_outputs.{key} is not supported by this server "
                               f"(supported: {', '.join(_SO_KINDS)})",
                               param=f"structured_outputs.{key}", code="unsupported_parameter")
            if value is None or (key == "json_object" and value is False):
                continue
            found.append((f"structured_outputs.{key}", key, value))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, kind, value))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(f"only one structured-output constraint is allowed per request, got "
                       f"{found[0][0]} and {found[1][0]}", param=found[1][0],
                       code="invalid_value")
    param, kind, value = found[0]
    return StructuredOutputsParams(kind, _spec(param, kind, value)), param


def _response_format(fmt, param: str = "response_format",
                     flat: bool = False) -> list[tuple[str, str, object]]:
    """Chat's response_format, or (`flat`) the Responses API's text.format, which holds the
    json_schema's name, schema and strict beside its type."""
    if not isinstance(fmt, dict):
        raise _invalid(param, "must be an object with a 'type'")
    kind = fmt.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [(param, "json_object", True)]
    if kind != "json_schema":
        raise _invalid(f"{param}.type",
                       f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    where = param if flat else f"{param}.json_schema"
    js = fmt if flat else fmt.get("json_schema")
    if not isinstance(js, dict):
        raise _invalid(where, "must be an object with a 'name'")
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise _invalid(f"{where}.name", "must be 1-64 letters, digits, underscores or dashes")
    if js.get("strict") not in (None, True, False):
        raise _invalid(f"{where}.strict", "must be a boolean")
    # The schema is enforced whether or not strict is set (as vLLM does); without one, any
    # JSON object.
    if js.get("schema") is None:
        return [(where, "json_object", True)]
    return [(f"{where}.schema", "json", js["schema"])]


def _spec(param: str, kind: str, value) -> str:
    if kind == "json":
        try:
            return json_spec(value)
        except ValueError as e:
            raise _invalid(param, str(e)) from None
    if kind == "json_object":
        if value is not True:
            raise _invalid(param, "must be true")
        return ""
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise _invalid(param, "must be a non-empty array of non-empty strings")
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise _invalid(param, "must be a non-empty string")
    return value


async def prepare(engine, req, params_list: list, settings,
                  tool_constraint: StructuredOutputsParams | None = None,
                  tool_param: str = "tool_choice") -> None:
    """Reads the request's constraint (or takes `tool_constraint`, the grammar that enforces
    its tool_choice or strict tools, named `tool_param` in errors), compiles it on the engine's grammar pool (a cache hit for a grammar seen
    before) within the timeout, and attaches it to every SamplingParams of the request. Raises
    APIError (400) for any problem with it."""
    found = request_constraint(req)
    if tool_constraint is not None:
        if found is not None:
            raise APIError(f"{found[1]} cannot be combined with a tool_choice that requires a "
                           "call (each constrains the whole output)", param=found[1],
                           code="invalid_value")
        found = tool_constraint, tool_param
    if found is None:
        return
    so, param = found
    so.param = param             # what a failure while generating names
    try:
        # The first use wraps the tokenizer for the grammar library (up to a second).
        manager = await asyncio.to_thread(engine.structured_outputs)
        future = manager.compiler.submit(so)
        await asyncio.wait_for(asyncio.wrap_future(future), settings.structured_outputs_timeout)
    except ValueError as e:
        raise _invalid(param, str(e)) from None
    except asyncio.TimeoutError:
        raise _invalid(param, f"did not compile within {settings.structured_outputs_timeout:g} "
                              "s (--structured-outputs-timeout); simplify it") from None
    for params in params_list:
        params.structured_outputs = so
