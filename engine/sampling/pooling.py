"""Embeddings: which pooling a checkpoint asks for, and pooling one request's hidden states.

A sentence-transformers checkpoint lists its modules in modules.json: the Transformer (weights at
the root, or in a subfolder for old saves), a Pooling module (1_Pooling/config.json), and
optionally Normalize (L2). We run the transformer; this file does the rest. Any other module
(Dense, LayerNorm, ...) would change the vector, so it stops the start-up instead of being skipped.

A plain generative checkpoint served for embeddings pools its last token and L2-normalizes, as
vLLM does for decoder-only models.

The engine computes an embedding request's prompt in chunks like any prefill; each chunk hands its
final-norm hidden rows to the request's `Pooler`, which keeps only what the mode needs (the running
sum for mean, the first row for CLS, the latest row for last token), so memory stays O(hidden).

A request with `token_ids` scores instead of embedding: its result is the raw logits of those
tokens at the prompt's last position (a yes/no reranker reads P("yes") from them; server/rerank.py).
The last row goes through the lm_head on the device and only those logits come back.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

MODES = ("mean", "cls", "lasttoken")

# sentence-transformers < 6 wrote one boolean per mode; 6 writes `pooling_mode`.
_LEGACY_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                     "pooling_mode_max_tokens": "max",
                     "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens": "weightedmean",
                     "pooling_mode_lasttoken": "lasttoken"}


@dataclass(slots=True, frozen=True)
class PoolingConfig:
    mode: str                                   # mean | cls | lasttoken
    normalize: bool                             # L2-normalize the pooled vector
    transformer_path: str = ""                  # the transformer's folder inside the checkpoint
    # `dimensions` (Matryoshka truncation) is allowed when the checkpoint says so:
    matryoshka_dimensions: tuple[int, ...] | None = None  # only these sizes
    is_matryoshka: bool = False                 # any size up to the hidden size
    declared: bool = False                      # the checkpoint says it (an embedding model)

    def check_dimensions(self, dimensions: int, size: int) -> str | None:
        """Why `dimensions` cannot be served for embeddings of `size` floats, or None."""
        if self.matryoshka_dimensions is not None:
            if dimensions not in self.matryoshka_dimensions:
                return ("this model supports dimensions in "
                        f"{list(self.matryoshka_dimensions)}, got {dimensions}")
            return None
        if not self.is_matryoshka:
            return ("this model does not support matryoshka representation: 'dimensions' "
                    "cannot change its embedding size")
        if not 1 <= dimensions <= size:
            return f"dimensions must be in [1, {size}] for this model, got {dimensions}"
        return None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def _pooling_mode(config: dict, path: str) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [m for key, m in _LEGACY_MODE_KEYS.items() if config.get(key)]
    if isinstance(mode, (list, tuple)):
        if len(mode) != 1:
            raise ValueError(f"{path}: pooling modes {list(mode) or '(none)'}; Taper pools with "
                             f"exactly one of {', '.join(MODES)}")
        mode = mode[0]
    if mode not in MODES:
        raise ValueError(f"{path}: pooling mode {mode!r} is not supported; supported: "
                         f"{', '.join(MODES)}")
    return mode


def read_pooling_config(model_dir: str) -> PoolingConfig | None:
    """The pooling of a sentence-transformers checkpoint, or None if `model_dir` has no
    modules.json with a Pooling module."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path}: expected a list of modules")
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], m.get("path", "")) for m in modules]
    if not any(kind == "Pooling" for kind, _ in kinds):
        return None
    mode, normalize, transformer_path = None, False, ""
    for i, (kind, path) in enumerate(kinds):
        if kind == "Transformer" and i == 0:
            transformer_path = path or ""
        elif kind == "Pooling" and mode is None:
            config_path = os.path.join(model_dir, path, "config.json")
            mode = _pooling_mode(_read_json(config_path), config_path)
        elif kind == "Normalize" and mode is not None:
            normalize = True
        else:
            raise ValueError(f"{modules_path}: module {i} ({kind}) is not supported; Taper runs "
                             "a Transformer, then Pooling, then optionally Normalize")
    hf_config = _read_json(os.path.join(model_dir, transformer_path, "config.json"))
    return PoolingConfig(mode, normalize, transformer_path, declared=True,
                         **_matryoshka(model_dir, hf_config))


def default_pooling_config(model_dir: str | None) -> PoolingConfig:
    """A generative checkpoint's embeddings: its last token, L2-normalized (vLLM's default)."""
    path = None if model_dir is None else os.path.join(model_dir, "config.json")
    hf_config = _read_json(path) if path and os.path.isfile(path) else {}
    return PoolingConfig("lasttoken", True, **_matryoshka(model_dir, hf_config))


def _matryoshka(model_dir: str | None, hf_config: dict) -> dict:
    """Matryoshka settings as vLLM reads them from config.json (`matryoshka_dimensions`,
    `is_matryoshka`), or a `truncate_dim` in config_sentence_transformers.json."""
    dims = hf_config.get("matryoshka_dimensions")
    st_path = None if model_dir is None else os.path.join(model_dir,
                                                           "config_sentence_transformers.json")
    truncate_dim = None
    if st_path and os.path.isfile(st_path):
        truncate_dim = _read_json(st_path).get("truncate_dim")
    return dict(matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
                is_matryoshka=bool(hf_config.get("is_matryoshka") or dims or truncate_dim))


@dataclass(slots=True)
class PoolingParams:
    """An embedding request: the engine pools instead of sampling. With `token_ids`, a scoring
    request: the result is those tokens' raw logits at the prompt's last position."""
    dimensions: int | None = None     # keep the first `dimensions` floats (then re-normalize)
    token_ids: tuple[int, ...] | None = None
    n = 1                             # one output, as a generation request with n = 1

    def __post_init__(self):
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError("dimensions must be at least 1")
        if self.token_ids is not None:
            self.token_ids = tuple(int(t) for t in self.token_ids)
            if not self.token_ids:
                raise ValueError("token_ids must name at least one token")
            if self.dimensions is not None:
                raise ValueError("dimensions does not apply to token logits")


class Pooler:
    """One request's pooling state, fed with each computed chunk's final-norm hidden rows."""

    def __init__(self, config: PoolingConfig, params: PoolingParams, num_tokens: int):
        self.config, self.params, self.num_tokens = config, params, num_tokens
        # token logits are read at the last position whatever the checkpoint pools with
        self.mode = "lasttoken" if params.token_ids else config.mode
        self.value: np.ndarray | None = None   # running sum (mean) or the kept row

    @property
    def token_ids(self) -> tuple[int, ...] | None:
        """The tokens whose logits the runner hands over instead of the last hidden row."""
        return self.params.token_ids

    @property
    def needs_every_token(self) -> bool:
        """Mean and CLS read tokens a prefix-cache hit would skip; the last token is always
        computed (the cache never covers it)."""
        return self.mode != "lasttoken"

    def rows_wanted(self, start: int, n: int) -> tuple[int, int]:
        """Which of a chunk's rows [start, start + n) this mode reads, as (first, end) offsets
        into the chunk (first == end: none)."""
        mode = self.mode
        if mode == "mean":
            return 0, n
        if mode == "cls":
            return (0, 1) if start == 0 else (0, 0)
        return (n - 1, n) if start + n == self.num_tokens else (n - 1, n - 1)

    def add(self, start: int, rows: np.ndarray):
        """rows: this chunk's wanted rows (rows_wanted), float32 (k, hidden), or (k,
        len(token_ids)) logits when scoring. A chunk at position 0 starts over (the request was
        preempted and is being recomputed)."""
        if start == 0:
            self.value = None
        if not len(rows):
            return
        if self.mode == "mean":
            total = rows.astype(np.float64).sum(axis=0)
            self.value = total if self.value is None else self.value + total
        else:
            self.value = rows[-1].astype(np.float64)

    def result(self) -> np.ndarray:
        """The embedding (or the token logits), float32."""
        if self.params.token_ids:
            return self.value.astype(np.float32)
        vec = self.value / self.num_tokens if self.mode == "mean" else self.value
        if self.params.dimensions is not None:
            vec = vec[:self.params.dimensions]
        if self.config.normalize:
            # sentence-transformers' Normalize: x / max(||x||, 1e-12)
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
        return vec.astype(np.float32)
