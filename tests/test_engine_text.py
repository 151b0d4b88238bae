"""Text through the whole engine (demo checkpoint, which ships a tokenizer): streamed deltas join
to the tokenizer's own decode, stop strings cut the text, held-back text is flushed at the end."""
import pytest

from engine import LLM, SamplingParams
from server.demo_model import write_demo_checkpoint

GEN = 24


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_demo_checkpoint(str(tmp_path_factory.mktemp("demo"))))


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.engine.tokenizer.encode("Hello there, how are you?")


def stream(llm, prompt, **params):
    """(text deltas, final output) of one request, stepping the engine by hand."""
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=GEN,
                                                   ignore_eos=True, **params))
    deltas = []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.text_delta)
    return deltas, out


def test_deltas_join_to_the_tokenizers_decode(llm, prompt):
    deltas, out = stream(llm, prompt, stop=["never-in-this-text"])  # holds back a suffix
    assert out.finish_reason == "length"
    assert "".join(deltas) == out.text == llm.engine.tokenizer.decode(out.token_ids)
    assert len(out.text) > 10


def test_stop_string_across_tokens_cuts_the_text(llm, prompt):
    _, full = stream(llm, prompt)
    stop = full.text[7:12]                  # spans several tokens
    cut = full.text.index(stop)
    deltas, out = stream(llm, prompt, stop=[stop])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert "".join(deltas) == out.text == full.text[:cut]
    _, out = stream(llm, prompt, stop=[stop], include_stop_str_in_output=True)
    assert out.text == full.text[:cut + len(stop)]
