"""Resolve a model argument to a local directory: a directory is used as is, anything else is a
Hugging Face hub id fetched with snapshot_download (which honours HF_HOME, HF_TOKEN and
HF_HUB_OFFLINE), restricted to configs, safetensors weights and tokenizer files."""
from __future__ import annotations

import os

ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "merges.txt",
                  "vocab.txt", "*.jinja"]
# Mistral repos ship consolidated.safetensors beside the HF shards; Llama repos ship original/.
IGNORE_PATTERNS = ["consolidated*.safetensors", "original/*"]


def resolve_model(model: str, revision: str | None = None) -> str:
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    if os.path.isabs(path) or model.startswith((".", "~")) or os.path.exists(path) or \
            model.count("/") > 1:
        raise FileNotFoundError(f"model directory {model} does not exist")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id=model, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                 ignore_patterns=IGNORE_PATTERNS)
    except Exception as e:  # hub errors come in many classes; all mean the same to the user
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise FileNotFoundError(f"{model} is neither a local directory nor a downloadable Hugging "
                                f"Face hub model{hint}: {type(e).__name__}: {e}") from e
