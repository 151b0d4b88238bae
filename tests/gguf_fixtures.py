"""What the GGUF test modules share about the fixtures in tests/data/gguf/: where a file is, its
source model's config, the maker scripts (loaded by path: tests/data is not a package), how far
a recorded reference can be trusted, and the file set a maker's fixtures JSON records."""
from __future__ import annotations

import importlib.util
import json
import os

from engine.models.model_config import ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "gguf")
TIE = 1e-4          # float files: comparison stops where transformers' top two are this close
QUANT_TIE = 0.05    # quantized files: ... where llama.cpp's top two are this close


def path_of(stem: str) -> str:
    return os.path.join(DATA, f"{stem}.gguf")


def source_config(name: str) -> ModelConfig:
    return ModelConfig.from_pretrained(os.path.join(DATA, f"{name}-source"))


def load_script(path: str):
    """The module of a script under tests/data (a maker), imported by its path."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trusted(margins: list[float], tie: float) -> int:
    """Leading steps before the first near-tie."""
    return next((i for i, m in enumerate(margins) if m < tie), len(margins))


class RecordedFixtures:
    """The files one maker's fixtures JSON records: `files` {stem: (model, kind)}, the float and
    the Q8_0 ones, and transformers' record of each (`reference`)."""

    def __init__(self, json_name: str, min_trusted_steps: int):
        with open(os.path.join(DATA, json_name)) as f:
            self.fix = json.load(f)
        self.files = {f"{name}-{kind}": (name, kind)
                      for name, m in self.fix["models"].items() for kind in m["files"]}
        self.float_files = [s for s, (_, k) in self.files.items() if k in ("f32", "f16", "bf16")]
        self.quant_files = [s for s, (_, k) in self.files.items() if k == "q8_0"]
        self.min_trusted_steps = min_trusted_steps

    def reference(self, stem: str) -> tuple[dict, int]:
        """transformers' record for `stem` and how many of its steps are clear of near-ties."""
        name, kind = self.files[stem]
        ref = self.fix["models"][name]["files"][kind]["transformers"]
        n = trusted(ref["margins"], TIE if stem in self.float_files else QUANT_TIE)
        assert n >= self.min_trusted_steps, f"{stem}: reference near-tie at step {n}; change the seed"
        return ref, n

    def atol(self, stem: str, ref_first) -> float:
        """First-step logits tolerance: float32 rounding for a float file, QUANT_TIE for Q8_0."""
        import numpy as np
        return 1e-4 * max(1.0, np.abs(ref_first).max()) if stem in self.float_files else QUANT_TIE

    def assert_greedy_matches_reference(self, stem: str) -> dict:
        """Taper's greedy run of the file equals transformers' on the file's weights (tokens up
        to the first near-tie, first-step logits within atol); returns that reference."""
        import numpy as np

        from engine.loader.gguf import read_gguf
        from test_gguf import greedy  # (here, not above: test_gguf imports this module)

        name, _ = self.files[stem]
        ref, n = self.reference(stem)
        ck = read_gguf(path_of(stem), progress=False)
        tokens, first = greedy(ck.config, ck.weights, self.fix["models"][name]["prompt_ids"], n)
        ref_first = np.array(ref["first_logits"])
        np.testing.assert_allclose(first, ref_first, rtol=0, atol=self.atol(stem, ref_first))
        assert tokens == ref["tokens"][:n]
        return ref

    def assert_llm_generates(self, stem: str):
        """The whole engine on the file: its own tokenizer encodes the prompt text as the source
        tokenizer did, and LLM's greedy tokens equal transformers' up to the first near-tie."""
        from engine import LLM, SamplingParams
        name, _ = self.files[stem]
        ref, n = self.reference(stem)
        llm = LLM(DATA, weight_file=f"{stem}.gguf", num_kv_blocks=64)
        assert llm.engine.tokenizer.encode(self.fix["prompt"]) == \
            self.fix["models"][name]["prompt_ids"]
        out = llm.generate([self.fix["prompt"]], SamplingParams(temperature=0, max_tokens=n,
                                                                ignore_eos=True))[0]
        assert list(out.token_ids) == ref["tokens"][:n]
