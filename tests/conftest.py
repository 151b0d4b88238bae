"""Fixtures shared across test files."""
import pytest

from tiny_tokenizers import build_byte_level, build_sentencepiece

pytest_plugins = ["ci_skips"]    # TAPER_CI: a CPU test skipped for a missing module fails the run


@pytest.fixture(scope="module")
def bl(tmp_path_factory):
    """Byte-level BPE tokenizer (engine.tokenizer.Tokenizer)."""
    return build_byte_level(tmp_path_factory.mktemp("bl"))


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    """SentencePiece-style byte-fallback tokenizer (engine.tokenizer.Tokenizer)."""
    return build_sentencepiece(tmp_path_factory.mktemp("sp"))
