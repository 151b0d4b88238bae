"""engine/text/detokenizer.py: streamed text never shows a broken character or part of a stop string."""
import pytest

from engine.text.detokenizer import IncrementalDetokenizer

from tiny_tokenizers import bytes_to_unicode

FFFD = "\ufffd"
TEXT = "hello 世界 你好😀🎉 world café"


def stream(detok, ids):
    """Feed ids one by one; return the deltas and the index of the token that stopped (or None)."""
    deltas, stopped_at = [], None
    for i, t in enumerate(ids):
        delta, stopped = detok.add_token(t)
        deltas.append(delta)
        if stopped:
            stopped_at = i
            break
    return deltas, stopped_at


def byte_ids(tok, text):
    """One token per UTF-8 byte (valid output of a byte-level model)."""
    m = bytes_to_unicode()
    return [tok.hf.convert_tokens_to_ids(m[b]) for b in text.encode("utf-8")]


def naive_has_fffd(tok, ids):
    return any(FFFD in tok.decode([t]) for t in ids)


def check_clean_stream(tok, ids, prompt=(), expected=None):
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=True, stop=[],
                                   include_stop_str_in_output=False)
    deltas, stopped_at = stream(detok, ids)
    assert stopped_at is None
    for d in deltas:
        assert FFFD not in d
    if expected is None:
        expected = tok.decode(ids)
    assert "".join(deltas) + detok.flush() == expected == detok.text
    return deltas


def test_byte_level_merges_split_characters(bl):
    ids = bl.encode(TEXT, add_special_tokens=False)
    # The input really splits characters: decoding token by token breaks them ...
    assert naive_has_fffd(bl, ids)
    # ... including merged tokens that hold 2 of the 4 bytes of an emoji.
    inv = {c: b for b, c in bytes_to_unicode().items()}
    raw = [bytes(inv[c] for c in tok) for tok in bl.convert_ids_to_tokens(ids)]
    assert any(len(r) >= 2 and r[0] >= 0xF0 and len(r) < 4 for r in raw)
    check_clean_stream(bl, ids)


def test_byte_level_one_token_per_byte(bl):
    ids = byte_ids(bl, TEXT)
    assert bl.decode(ids) == TEXT and naive_has_fffd(bl, ids)
    deltas = check_clean_stream(bl, ids, prompt=bl.encode("hi"))
    # A 4-byte character shows up whole, once, on its last byte.
    emoji_end = len("hello 世界 你好😀".encode("utf-8")) - 1
    assert deltas[emoji_end] == "😀" and deltas[emoji_end - 1] == ""


def test_sentencepiece_byte_fallback(sp):
    ids = sp.encode(TEXT, add_special_tokens=False)
    assert "<0xF0>" in sp.convert_ids_to_tokens(ids) and naive_has_fffd(sp, ids)
    check_clean_stream(sp, ids)


def test_sentencepiece_leading_space_after_prompt(sp):
    # After a prompt, the first output word keeps its space ('▁world' -> ' world'), which a
    # decode of the output alone would strip.
    prompt = sp.encode("hello")
    ids = sp.encode(" world 你", add_special_tokens=False)[1:]   # drop the lone '▁'
    assert sp.convert_ids_to_tokens(ids)[0] == "▁world"
    full = sp.decode(prompt + ids)
    check_clean_stream(sp, ids, prompt=prompt, expected=full[len(sp.decode(prompt)):])
    assert full.endswith(" world 你")


def test_skip_special_tokens(bl):
    im_end = bl.hf.convert_tokens_to_ids("<|im_end|>")
    ids = bl.encode("你好", add_special_tokens=False) + [im_end] + \
        bl.encode(" world", add_special_tokens=False)
    for skip, expected in ((True, "你好 world"), (False, "你好<|im_end|> world")):
        detok = IncrementalDetokenizer(bl, [], skip_special_tokens=skip, stop=[],
                                       include_stop_str_in_output=False)
        deltas, _ = stream(detok, ids)
        assert "".join(deltas) == expected


@pytest.mark.parametrize("make_ids", ["merged", "bytes"])
@pytest.mark.parametrize("stop,include,expected", [
    (["好😀"], False, "hello 世界 你"),
    (["好😀"], True, "hello 世界 你好😀"),
    (["lo 世"], False, "hel"),
    (["rld", "😀🎉 w"], False, "hello 世界 你好"),         # the earliest match wins
    (["🎉 wo", "界 你好"], True, "hello 世界 你好"),
])
def test_stop_strings_never_leak(bl, make_ids, stop, include, expected):
    ids = bl.encode(TEXT, add_special_tokens=False) if make_ids == "merged" else byte_ids(bl, TEXT)
    detok = IncrementalDetokenizer(bl, [], skip_special_tokens=True, stop=stop,
                                   include_stop_str_in_output=include)
    deltas, stopped_at = stream(detok, ids)
    assert stopped_at is not None and detok.stopped
    shown = ""
    for d in deltas:
        shown += d
        assert FFFD not in d
        assert expected.startswith(shown)   # never text past the cut, not even a part of it
    assert shown == expected == detok.text
    # It stops on the token that completes the stop string, not later.
    first = min(stop, key=TEXT.index)
    assert first not in bl.decode(ids[:stopped_at]) and first in bl.decode(ids[:stopped_at + 1])
    assert detok.add_token(ids[0]) == ("", True)


def test_held_text_released_when_match_fails(bl):
    detok = IncrementalDetokenizer(bl, [], skip_special_tokens=True, stop=["world!"],
                                   include_stop_str_in_output=False)
    ids = byte_ids(bl, "a wor")
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == "a "          # "wor" could start "world!": held back
    assert detok.add_token(byte_ids(bl, "k")[0]) == ("work", False)
    stream(detok, byte_ids(bl, " wo"))
    assert detok.flush() == "wo" and detok.text == "a work wo"


def test_stop_string_in_sentencepiece_stream(sp):
    ids = sp.encode("hello 你STOP world", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp, [], skip_special_tokens=True, stop=["STOP"],
                                   include_stop_str_in_output=False)
    deltas, stopped_at = stream(detok, ids)
    assert stopped_at is not None and "".join(deltas) == "hello 你" == detok.text


def test_min_tokens_defers_stop_strings(bl):
    ids = byte_ids(bl, "ab ab")
    detok = IncrementalDetokenizer(bl, [], skip_special_tokens=True, stop=["ab"],
                                   include_stop_str_in_output=False, min_tokens=3)
    deltas, stopped_at = stream(detok, ids)
    assert stopped_at == 4 and detok.text == "ab "


def test_window_stays_small(bl):
    ids = bl.encode(TEXT * 50, add_special_tokens=False)
    detok = IncrementalDetokenizer(bl, bl.encode("prompt " * 100), skip_special_tokens=True,
                                   stop=["never"], include_stop_str_in_output=False)
    longest = 0
    for t in ids:
        detok.add_token(t)
        longest = max(longest, len(detok._ids))
    assert longest <= 8
    assert detok.text + detok.flush() == bl.decode(ids)


def test_output_cut_inside_a_character_ends_as_the_whole_decode(bl):
    """max_tokens can stop between the bytes of one character: the held tokens are released on
    flush as decoding the whole output shows them (U+FFFD), not dropped."""
    ids = byte_ids(bl, "ok 😀")[:-2]            # the emoji's first 2 of 4 bytes
    detok = IncrementalDetokenizer(bl, bl.encode("hi"))
    streamed = "".join(detok.add_token(t)[0] for t in ids)
    assert streamed == "ok "
    assert streamed + detok.flush() == bl.decode(ids) == detok.text
    assert detok.text.endswith(FFFD)
