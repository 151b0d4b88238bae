"""LoRA serving settings, with vLLM's names: the adapters loaded at start (--lora-modules), how many
one step may run (--max-loras: the slots) and the largest rank a slot holds (--max-lora-rank)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

# vLLM's default max_lora_rank; adapters of a larger rank are refused
DEFAULT_MAX_LORA_RANK = 16
MAX_LORA_RANK_LIMIT = 512       # vLLM's largest choice


@dataclass(slots=True)
class LoraConfig:
    modules: dict[str, str] = field(default_factory=dict)   # name -> PEFT adapter directory
    max_loras: int = 1                 # adapters one step may run: the slots on the device
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    def __post_init__(self):
        if isinstance(self.modules, (list, tuple)):
            self.modules = parse_lora_modules(self.modules)
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras!r}")
        if (not isinstance(self.max_lora_rank, int)
                or not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT):
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK_LIMIT}], got "
                             f"{self.max_lora_rank!r}")
        for name in self.modules:
            check_lora_name(name)


def check_lora_name(name) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
    return name


def parse_lora_modules(items) -> dict[str, str]:
    """--lora-modules' entries, as vLLM takes them: `name=path`, or JSON
    `{"name": ..., "path": ...}` (its base_model_name is accepted and ignored: the base is the
    served model). A name given twice is a ValueError."""
    modules: dict[str, str] = {}
    for item in items:
        item = item.strip()
        if item.startswith("{"):
            try:
                spec = json.loads(item)
            except ValueError as e:
                raise ValueError(f"LoRA module {item!r}: not valid JSON ({e})") from None
            if not isinstance(spec, dict) or not {"name", "path"} <= spec.keys():
                raise ValueError(f"LoRA module {item!r}: JSON needs \"name\" and \"path\"")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = item.partition("=")
            if not sep or not path:
                raise ValueError(f"LoRA module {item!r}: expected name=path (or JSON with "
                                 "name and path)")
        check_lora_name(name)
        if name in modules:
            raise ValueError(f"LoRA module {name!r} is given twice")
        modules[name] = path
    return modules
