"""PEFT adapters written by `peft` itself for the LoRA tests, and transformers with an adapter
merged (peft's merge_and_unload) as their oracle."""
from __future__ import annotations

import torch

from hf_oracle import load_hf

# name -> peft.LoraConfig arguments. init_lora_weights=False leaves A and B random (B is zero by
# default, which would make every adapter a no-op).
ADAPTERS = {
    # every projection, alpha / r scaling, one module's rank and another's alpha overridden
    "alpha": dict(r=8, lora_alpha=16, rank_pattern={"o_proj": 4},
                  alpha_pattern={"down_proj": 4},
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                  "down_proj"]),
    # rsLoRA: alpha / sqrt(r)
    "beta": dict(r=4, lora_alpha=6, use_rslora=True,
                 target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
    # parts of both fused projections only, one layer only
    "gamma": dict(r=2, lora_alpha=4, target_modules=["k_proj", "gate_proj"],
                  layers_to_transform=[1]),
}


def write_adapter(base, path, seed: int = 0, **lora_args) -> str:
    """An adapter for the transformers model `base` (a checkpoint directory, or the model),
    saved by peft into `path`."""
    from peft import LoraConfig, get_peft_model

    model = load_hf(base) if isinstance(base, str) else base
    torch.manual_seed(seed)
    lora_args.setdefault("init_lora_weights", False)
    peft_model = get_peft_model(model, LoraConfig(**lora_args))
    peft_model.save_pretrained(str(path))
    peft_model.unload()          # the base model as it was, for the next adapter
    return str(path)


def merged(base, adapter_dir: str):
    """The transformers model (a checkpoint directory, or a model to copy) with the adapter
    merged into its weights."""
    import copy

    from peft import PeftModel
    model = load_hf(base) if isinstance(base, str) else copy.deepcopy(base)
    return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
