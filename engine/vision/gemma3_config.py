"""Gemma 3's vision settings: config.json `vision_config` (a SigLIP tower), the projector's
mm_tokens_per_image and the image token ids. Its image processor: engine/vision/
gemma3_preprocess.py.

Every image is mm_tokens_per_image tokens, pooled from the tower's patch grid to a square grid
of tokens (grid_thw (1, side, side), one token per cell: spatial_merge_size 1 for
engine/vision/inputs.py). The prompt holds an image as the processor's text writes it:
"\\n\\n<start_of_image>" + <image_soft_token> x mm_tokens_per_image + "<end_of_image>\\n\\n" in
place of the template's <start_of_image>; expanded in the text (the newlines merge with their
neighbours' when tokenized), before tokenizing (`image_text`). With pan-and-scan crops the
processor writes "Here is the original image " + that + " and here are some crops to help you
see better " + that for each crop, joined by spaces; each crop is an image of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

# Gemma3TextConfig's defaults: the hub's Gemma 3 config.json files leave most of them out of
# text_config (gemma-3-4b-it names only its sizes, layers, window and rope_scaling).
TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072, rms_norm_eps=1e-6,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    query_pre_attn_scalar=256, sliding_window=4096)


@dataclass(slots=True)
class Gemma3VisionConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    num_channels: int = 3
    spatial_merge_size: int = 1       # the token grid is the pooled grid (module docstring)
    expands_in_text = True            # the server expands <start_of_image> in the prompt text

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return int(round(self.mm_tokens_per_image ** 0.5))

    @property
    def pool(self) -> int:
        """The projector's average-pooling kernel (and stride), in patches."""
        return self.patches_per_side // self.tokens_per_side

    def image_text(self, token_string, num_crops: int = 0) -> str:
        """The text one image (and its pan-and-scan crops) stands for in the prompt, as
        transformers' Gemma3Processor writes it; token_string(id) -> the token's text."""
        one = ("\n\n" + token_string(self.boi_token_id)
               + token_string(self.image_token_id) * self.mm_tokens_per_image
               + token_string(self.eoi_token_id) + "\n\n")
        if not num_crops:
            return one
        return (f"Here is the original image {one} and here are some crops to help you see "
                "better " + " ".join([one] * num_crops))


def parse_gemma3_vision_config(arch: str, cfg: dict) -> Gemma3VisionConfig:
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ValueError(f"{arch}: config.json has no vision_config")
    text = {**TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{arch}: vision hidden_act {act!r} is not supported "
                         "(gelu_pytorch_tanh only)")
    if v.get("vision_use_head"):
        raise ValueError(f"{arch}: a SigLIP tower with its pooling head (vision_use_head) is "
                         "not Gemma 3's")
    c = Gemma3VisionConfig(
        architecture=arch, hidden_size=int(v.get("hidden_size", 1152)),
        intermediate_size=int(v.get("intermediate_size", 4304)),
        num_layers=int(v.get("num_hidden_layers", 27)),
        num_heads=int(v.get("num_attention_heads", 16)),
        image_size=int(v.get("image_size", 896)), patch_size=int(v.get("patch_size", 14)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        mm_tokens_per_image=int(cfg.get("mm_tokens_per_image", 256)),
        text_hidden_size=int(text["hidden_size"]),
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262144))),
        boi_token_id=int(cfg.get("boi_token_index", cfg.get("boi_token_id", 255999))),
        eoi_token_id=int(cfg.get("eoi_token_index", cfg.get("eoi_token_id", 256000))),
        num_channels=int(v.get("num_channels", 3)))
    if c.hidden_size % c.num_heads:
        raise ValueError(f"{arch}: vision hidden_size {c.hidden_size} is not a multiple of its "
                         f"{c.num_heads} heads")
    side = c.tokens_per_side
    if (side * side != c.mm_tokens_per_image or c.image_size % c.patch_size
            or c.patches_per_side % side):
        raise ValueError(f"{arch}: mm_tokens_per_image {c.mm_tokens_per_image} must be a square "
                         f"whose side divides the {c.image_size // c.patch_size} patches a side "
                         f"(image_size {c.image_size} / patch_size {c.patch_size})")
    return c
