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


def resolve_gguf(model: str | None, weight_file: str, revision: str | None = None) -> str:
    """The local path of a GGUF file: `weight_file` itself, or inside the `model` directory, or
    downloaded from the `model` hub repo (with its other shards when the file is split)."""
    path = os.path.expanduser(weight_file)
    if os.path.isfile(path):
        return path
    if model is None:
        raise FileNotFoundError(f"GGUF file {weight_file} does not exist")
    if os.path.isdir(os.path.expanduser(model)):
        path = os.path.join(os.path.expanduser(model), weight_file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file {weight_file} is not in {model}")
        return path
    import re
    split = re.match(r"(.*)-\d{5}-of-\d{5}\.gguf$", weight_file)
    pattern = f"{split.group(1)}-*-of-*.gguf" if split else weight_file
    try:
        from huggingface_hub import snapshot_download
        local = snapshot_download(repo_id=model, revision=revision, allow_patterns=[pattern])
    except Exception as e:
        raise FileNotFoundError(f"could not fetch {weight_file} from the hub repo {model}: "
                                f"{type(e).__name__}: {e}") from e
    path = os.path.join(local, weight_file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the hub repo {model} has no file {weight_file}")
    return path

