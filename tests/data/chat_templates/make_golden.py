"""Writes golden/<template>.<case>.txt: each chat template here rendered by transformers'
apply_chat_template over the conversation of tests/test_chat_templates.py, with the tokenizer
its test uses (bos "<s>", eos "<|im_end|>"). Run from the repository root:

    python tests/data/chat_templates/make_golden.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_chat_templates import CASES, TEMPLATES, golden_path, transformers_rendering  # noqa: E402
from test_tool_calls_server import make_tokenizer  # noqa: E402


def main():
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tokenizer(Path(tmp)).hf
        for template in TEMPLATES:
            for case in CASES:
                path = golden_path(template, case)
                path.parent.mkdir(exist_ok=True)
                path.write_text(transformers_rendering(hf, template, case))
                print(path.relative_to(ROOT))


if __name__ == "__main__":
    main()
