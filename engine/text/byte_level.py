"""GPT-2's byte-level alphabet: the 256 printable characters byte-level BPE vocabularies spell
bytes with (tokenizers' ByteLevel pre-tokenizer and decoder use the same map)."""
from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
