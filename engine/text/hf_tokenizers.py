"""transformers' tokenizer classes, imported without torch.

Taper uses transformers only for its tokenizers (the fast tokenizer wrapper and chat templates), yet
some transformers releases import torch from that import chain whenever torch is installed:
5.17's `tokenization_utils_tokenizers` imports `modeling_gguf_pytorch_utils`, which runs
`if is_torch_available(): import torch` at module level (5.23 no longer does). On a GPU machine,
where torch is usually installed, that costs seconds of start-up, torch's own thread pools and CUDA
context beside ours.

The guard: while transformers' tokenizer modules are first imported, and only if torch is not
loaded already, transformers' `is_torch_available` answers False. Those modules then skip their
torch imports; nothing they do for a tokenizer needs torch. The rest of transformers, and any code
imported after this, sees the real answer. The price, where a release does import torch there:
in the same process, the torch-only functions of the modules imported under the guard (5.17:
transformers' GGUF model-weight loader) cannot run; loading models is not their job here.

Where torch is not installed (Taper's own install), `import transformers` warns "PyTorch was not
found. Models won't be available ..." on every start: true of transformers' models, which Taper
never uses, and alarming in an engine that runs without PyTorch by design. That one notice is
dropped while transformers is first imported here; its other warnings pass.
"""
from __future__ import annotations

import contextlib
import logging
import sys

NO_TORCH_NOTICE = "PyTorch was not found. Models won't be available"


def _not_the_no_torch_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(NO_TORCH_NOTICE)


@contextlib.contextmanager
def _no_torch_notice_dropped():
    logger = logging.getLogger("transformers")     # transformers/__init__.py's logger
    logger.addFilter(_not_the_no_torch_notice)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_no_torch_notice)


@contextlib.contextmanager
def _torch_hidden_from_transformers():
    if "torch" in sys.modules:        # already paid for: nothing to hide
        yield
        return
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils
    saved = utils.is_torch_available, import_utils.is_torch_available
    utils.is_torch_available = import_utils.is_torch_available = lambda: False
    try:
        yield
    finally:
        utils.is_torch_available, import_utils.is_torch_available = saved


with _no_torch_notice_dropped(), _torch_hidden_from_transformers():
    from transformers import PreTrainedTokenizerFast  # noqa: E402


def auto_tokenizer():
    """transformers.AutoTokenizer (for checkpoints without tokenizer.json), imported under the
    same guard, on first use: unguarded, it imports torch where torch is installed (5.17 and 5.23
    alike)."""
    with _torch_hidden_from_transformers():
        from transformers import AutoTokenizer
    return AutoTokenizer


__all__ = ["PreTrainedTokenizerFast", "auto_tokenizer"]
