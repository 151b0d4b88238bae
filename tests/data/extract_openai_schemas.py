"""Regenerate openai_schemas.json from the official OpenAI OpenAPI spec (run by hand, not by tests).

    python tests/data/extract_openai_schemas.py /path/to/openapi.yaml

Copies the response schemas the server tests validate against, with every schema they reference,
into JSON Schema (draft 2020-12) documents (openai_schemas.json; the Responses API's, which
reference much more, apart in openai_responses_schemas.json): descriptions dropped, OpenAPI's `nullable: true`
rewritten as `anyOf [..., null]`. One addition: `CreateCompletionStreamResponse`, the spec's
CreateCompletionResponse with a nullable `finish_reason` and `usage`, because the spec reuses that
schema for streamed completion chunks, whose non-final chunks carry `finish_reason: null` (and,
with `stream_options.include_usage`, `usage: null`) on the wire, as the chat chunk schema allows.
"""
import copy
import json
import os
import sys

import yaml

ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "CreateCompletionResponse", "ListModelsResponse", "Model", "ErrorResponse"]
RESPONSES_ROOTS = ["Response", "ResponseStreamEvent", "ResponseItemList"]
ROOTS += ["CreateEmbeddingResponse"]      # /v1/embeddings (floats; base64 is a string)
DROP = {"description", "x-oaiMeta", "example", "examples", "title", "deprecated",
        "x-stainless-const", "x-oaiTypeLabel", "x-oaiExpandable"}


def clean(node):
    if isinstance(node, list):
        return [clean(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: ({p: clean(s) for p, s in v.items()} if k == "properties" else clean(v))
           for k, v in node.items() if k not in DROP}
    if out.pop("nullable", False):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def pick(schemas, roots) -> dict:
    """The `roots` and every schema they reference, cleaned."""
    picked = {}

    def walk(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref:
                name = ref.rsplit("/", 1)[-1]
                if name not in picked:
                    picked[name] = schemas[name]
                    walk(schemas[name])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for name in roots:
        picked[name] = schemas[name]
        walk(schemas[name])
    return {name: clean(s) for name, s in sorted(picked.items())}


def write(defs: dict, spec: dict, name: str):
    text = json.dumps(defs, indent=1, sort_keys=True)
    text = text.replace("#/components/schemas/", "#/$defs/")
    doc = {"$schema": "https://json-schema.org/draft/2020-12/schema",
           "source": f"OpenAI OpenAPI {spec['info']['version']}", "$defs": json.loads(text)}
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {out}: {len(defs)} schemas")


def main(spec_path):
    spec = yaml.safe_load(open(spec_path))
    schemas = spec["components"]["schemas"]
    defs = pick(schemas, ROOTS)
    stream = copy.deepcopy(defs["CreateCompletionResponse"])
    reason = stream["properties"]["choices"]["items"]["properties"]["finish_reason"]
    stream["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
        "anyOf": [reason, {"type": "null"}]}
    stream["properties"]["usage"] = {"anyOf": [stream["properties"]["usage"], {"type": "null"}]}
    defs["CreateCompletionStreamResponse"] = stream
    write(defs, spec, "openai_schemas.json")
    write(pick(schemas, RESPONSES_ROOTS), spec, "openai_responses_schemas.json")


if __name__ == "__main__":
    main(sys.argv[1])
