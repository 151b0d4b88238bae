"""Which part of each checkpoint tensor a tensor-parallel rank holds (Megatron's split), and cutting
it from a lazily read tensor so that a rank reads only its part.

    q/k/v (and Phi-3's fused qkv_proj)   column-parallel: each rank its query heads and their KV
                                          heads; with fewer KV heads than ranks, a KV head is
                                          replicated on the ranks whose query heads read it
    o_proj (Phi-2's dense)                row-parallel: the input columns of the rank's heads
    gate/up (GLM-4's and Phi-3's fused    column-parallel: each rank a slice of the intermediate
      gate_up_proj, every expert's,       size (MoE experts split within the ranks by default)
      Phi-2's fc1)
    down_proj (Phi-2's fc2)               row-parallel: the same slice of its input columns
    experts.{e}.* under expert parallel   whole, on the rank holding expert e (E / ranks
      (--enable-expert-parallel)          contiguous experts each), absent from the others; the
                                          shared expert stays split within as above; GPT-OSS's
                                          and Llama 4's stacked experts.gate_up_proj/down_proj
                                          (E first; biases, MXFP4 blocks and scales) its rows
    multi-head latent attention           by head: engine/parallel/sharding_mla.py
    self_attn.sinks (GPT-OSS)             the rank's heads' sinks
    q_norm/k_norm over all heads          the rank's heads' part (MiniMax-M2: the norm's mean
                                          square is all-reduced, engine/models/minimax_m2.py)
    q/k_layernorm.norms.{h} (StableLM)    the rank's heads' norms, named by the whole model's
                                          head index (engine/models/stablelm.py)
    embed_tokens, lm_head (and its bias)  vocab-parallel: each rank ceil(V / ranks) rows, the
                                          last rank's padded with zero rows
    linear_attn.* and the gated q_proj    the hybrid families' DeltaNet heads with their state,
      (Qwen3-Next, Qwen3.5)               the gated attention's heads with their gates:
                                          engine/parallel/linear_attention_shards.py
    row-parallel biases                   rank 0's is the checkpoint's, the others zero (the
                                          all-reduce after the projection adds it once)
    a vision tower and its projector      whole on rank 0, absent from the others:
                                          engine/parallel/sharding_vision.py
    everything else (norms, routers)      replicated

A tensor arrives as the loader has it: a memory-mapped array (safetensors, a GGUF's float tensors)
or a QuantizedWeight over memory-mapped ggml blocks. A cut along one range is a view, read when
the model copies it into place; pieces of fused tensors and padding are copied at once. Either
way only the rank's bytes are read, and no rank holds a whole tensor. Quantized tensors are cut
along whole blocks (ggml's 32 or 256 elements along K, FP8's scale blocks, GPTQ/AWQ's groups and
8-code words: engine/parallel/sharding_int4.py; compressed-tensors' int4 alike:
sharding_compressed.py; Marlin-format checkpoints along their 16 x 64 tiles: sharding_marlin.py),
else the load stops naming the format and the tensor.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from engine.models.kv_scales import KV_SCALE_NAMES
from engine.models.model_config import ModelConfig
from engine.parallel import linear_attention_shards
from engine.parallel.cuts import Cut, cut_array, even
from engine.parallel.sharding_mla import mla_cut
from engine.parallel.sharding_vision import check_vision_split, is_tower_tensor, stacked_expert_cut


@dataclass(frozen=True)
class TensorParallel:
    """A rank's place in its group, carried by the model's (local) config: the config's head
    counts and sizes are then the rank's, and its vocab_size the rank's padded share of the
    vocabulary, of which `vocab_size` here is the whole."""
    rank: int
    size: int
    vocab_size: int
    vocab_start: int
    comm: object = dataclasses.field(compare=False, repr=False)
    # Expert parallel: the experts [start, stop) this rank holds whole (None: every expert, each
    # split within the ranks).
    experts: tuple[int, int] | None = None
    # The whole model's index of the rank's first KV head (its first query head's is
    # rank * heads): StableLM's per-head q/k norms are named by it.
    kv_head_start: int = 0


ZERO_UNLESS_RANK0 = "zero unless rank 0"

# Quantization methods whose tensors can be cut (others stop the load, named).
SPLITTABLE_QUANT = ("fp8", "gptq", "awq", "compressed-tensors", "marlin")

_Q = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")
_KV = re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$")
_QKV = re.compile(r"\.self_attn\.qkv_proj\.(weight|bias)$")
_O = re.compile(r"\.self_attn\.(o_proj|dense)\.weight$")        # (dense: Phi-2's)
_UP = re.compile(r"\.(gate_proj|up_proj|w1|w3|mlp\.fc1)\.(weight|bias)$")
_GATE_UP = re.compile(r"\.gate_up_proj\.(weight|bias)$")
_DOWN = re.compile(r"\.(down_proj|w2|mlp\.fc2)\.weight$")
_ROW_BIAS = re.compile(r"\.(o_proj|down_proj|w2|self_attn\.dense|mlp\.fc2)\.bias$")
# (language_model.: Llama 4's multimodal layout, model.language_model.: Qwen3-VL's, renamed by
# their families' files after the cut)
_VOCAB = re.compile(r"^(language_model\.|model\.language_model\.)?"
                    r"((model\.)?embed_tokens\.weight|lm_head\.(weight|bias))$")
_KV_SCALES = tuple(f".{name}" for pair in KV_SCALE_NAMES for name in pair)
# One routed expert's tensors (weights, FP8 scales, biases); not `shared_experts.` (DeepSeek's).
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# Every expert's tensor stacked along the first axis (GPT-OSS's; MXFP4's blocks and scales).
_STACKED_EXPERTS = re.compile(
    r"\.(mlp|feed_forward)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_SINKS = re.compile(r"\.self_attn\.sinks$")
# q/k norms over all heads at once (MiniMax-M2's; Qwen3's per-head ones are one head wide)
_Q_NORM = re.compile(r"\.self_attn\.q_norm\.weight$")
_K_NORM = re.compile(r"\.self_attn\.k_norm\.weight$")
# StableLM's per-head q/k LayerNorms, one tensor per head (held by the ranks holding the head)
_HEAD_NORM = re.compile(r"\.self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight$")


def expert_of(name: str) -> int | None:
    """The routed expert a checkpoint tensor belongs to, or None."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None



# Families whose experts split only across ranks, whole (their stacked, interleaved gate/up is
# not cut within), and the quantization methods their checkpoints use on those experts alone.
EXPERTS_ACROSS_ONLY = {"GptOssForCausalLM": "mxfp4", "Llama4ForCausalLM": None}


class ShardPlan:
    """The cut of every tensor for one rank of `size`, checked against the config first (a
    model that cannot be split stops before anything is read). expert_parallel: MoE experts
    split across the ranks, whole (vLLM's --enable-expert-parallel), instead of within them."""

    def __init__(self, config: ModelConfig, rank: int, size: int, expert_parallel: bool = False):
        self.config, self.rank, self.size = config, rank, size
        self.expert_parallel = expert_parallel and config.moe is not None
        c = config
        arch = c.architecture
        if c.vision is not None:        # the tower whole on rank 0 (sharding_vision.py)
            check_vision_split(arch)
        if arch in EXPERTS_ACROSS_ONLY and not expert_parallel:
            raise ValueError(f"tensor parallel: {arch}'s experts split across ranks only, "
                             f"whole: add --enable-expert-parallel")
        if c.num_attention_heads % size:
            raise ValueError(f"tensor parallel {size}: {arch} has {c.num_attention_heads} "
                             f"attention heads, not divisible by {size}")
        hkv = c.num_key_value_heads
        if hkv % size and size % hkv:
            raise ValueError(f"tensor parallel {size}: {arch} has {hkv} KV heads; a split needs "
                             f"their number to divide or be divisible by {size}")
        even(c.intermediate_size, 0, size, f"{arch}'s intermediate_size")
        if c.linear_attention is not None:
            linear_attention_shards.check(c, size)
        self.experts = None
        if self.expert_parallel:
            E = c.moe.num_experts
            if E % size:
                raise ValueError(f"expert parallel {size}: {arch} has {E} experts, not "
                                 f"divisible by {size} (each rank holds E / {size} whole experts)")
            self.experts = (rank * E // size, (rank + 1) * E // size)
        elif c.moe is not None:
            even(c.moe.intermediate_size, 0, size, f"{arch}'s expert intermediate size")
        if c.moe is not None and c.moe.shared_intermediate_size:
            even(c.moe.shared_intermediate_size, 0, size,
                 f"{arch}'s shared expert intermediate size")
        q = c.quantization_config
        method = q.get("quant_method") if q else None
        experts_only = self.expert_parallel and EXPERTS_ACROSS_ONLY.get(arch) == method
        if method is not None and method not in SPLITTABLE_QUANT and not experts_only:
            raise ValueError(f"tensor parallel: {method} checkpoints cannot be split across ranks "
                             f"yet (splittable: unquantized safetensors, fp8 with block scales, "
                             f"gptq, awq, compressed-tensors int4 and FP8, marlin, GGUF, --isq)")
        self.fp8_block = tuple(q["weight_block_size"]) if method == "fp8" and q.get(
            "weight_block_size") else None
        # the packed layers' own cut (GPTQ/AWQ, compressed-tensors, Marlin-format): a module
        # whose shard() takes the tensors of its format's layers
        self.packed = None
        if method in ("gptq", "awq"):
            from engine.parallel import sharding_int4
            self.packed = sharding_int4
        elif method == "compressed-tensors":
            from engine.parallel import sharding_compressed
            sharding_compressed.check(q)
            self.packed = sharding_compressed
        elif method == "marlin":
            from engine.parallel import sharding_marlin
            self.packed = sharding_marlin
        self.heads = c.num_attention_heads // size
        self.kv_heads = hkv // size if hkv % size == 0 else 1
        self.vocab_share = -(-c.vocab_size // size)
        self.gemma4 = None
        if arch == "Gemma4ForCausalLM":     # per-layer head sizes, stacked GeGLU experts
            from engine.parallel import sharding_gemma4
            sharding_gemma4.check(self)
            self.gemma4 = sharding_gemma4

    # ---- the rank's sizes

    def local_config(self, comm) -> ModelConfig:
        """The config the rank's model is built with (TensorParallel says what it is a share of)."""
        c, n = self.config, self.size
        moe = c.moe and dataclasses.replace(
            c.moe, intermediate_size=c.moe.intermediate_size // (1 if self.experts else n),
            shared_intermediate_size=c.moe.shared_intermediate_size // n)
        if self.gemma4 is not None:
            c = dataclasses.replace(c, family=self.gemma4.local_family(self, c.family))
        return dataclasses.replace(
            c, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            intermediate_size=c.intermediate_size // n, vocab_size=self.vocab_share, moe=moe,
            linear_attention=c.linear_attention and linear_attention_shards.local(
                c.linear_attention, n),
            tensor_parallel=TensorParallel(self.rank, n, c.vocab_size,
                                           self.rank * self.vocab_share, comm, self.experts,
                                           self.kv_head_range()[0]))

    def expert_map(self) -> str:
        """Which experts each rank holds, for the start-up log."""
        E, n = self.config.moe.num_experts, self.size
        return (f"expert parallel {n}: " + ", ".join(
            f"rank {r} holds experts {r * E // n}-{(r + 1) * E // n - 1}" for r in range(n))
            + f" (of {E})")

    def q_rows(self) -> tuple[int, int]:
        d = self.config.head_dim
        return self.rank * self.heads * d, (self.rank + 1) * self.heads * d

    def kv_head_range(self) -> tuple[int, int]:
        hkv, n = self.config.num_key_value_heads, self.size
        first = self.rank * hkv // n if hkv % n == 0 else self.rank // (n // hkv)
        return first, first + self.kv_heads

    def kv_rows(self) -> tuple[int, int]:
        a, b = self.kv_head_range()
        return a * self.config.head_dim, b * self.config.head_dim

    # ---- the cut of each tensor

    def cut(self, name: str, shape: tuple[int, ...]):
        """A Cut, ZERO_UNLESS_RANK0, or None (the whole tensor: replicated, or under expert
        parallel one of the rank's experts)."""
        c, r, n = self.config, self.rank, self.size
        if self.gemma4 is not None and (
                family_cut := self.gemma4.cut(self, name, shape)) is not NotImplemented:
            return family_cut
        if self.experts is not None and expert_of(name) is not None:
            return None
        if c.linear_attention is not None and (
                hybrid := linear_attention_shards.cut(self, name, shape)) is not None:
            return hybrid
        if self.experts is not None and _STACKED_EXPERTS.search(name):
            return Cut(0, (self.experts,))
        if c.mla is not None and (by_head := mla_cut(name, c.mla, self.heads, r)) is not None:
            return by_head
        if c.vision is not None and c.moe is not None and (
                stacked := stacked_expert_cut(name, shape, c, r, n)) is not None:
            return Cut(stacked[0], stacked[1])
        if _SINKS.search(name):
            return Cut(0, ((r * self.heads, (r + 1) * self.heads),))
        if _Q_NORM.search(name) and shape == (c.q_size,) and c.q_size > c.head_dim:
            return Cut(0, (self.q_rows(),))
        if _K_NORM.search(name) and shape == (c.kv_size,) and c.kv_size > c.head_dim:
            return Cut(0, (self.kv_rows(),))
        if _VOCAB.match(name):
            start = min(r * self.vocab_share, shape[0])
            stop = min(start + self.vocab_share, shape[0])
            return Cut(0, ((start, stop),), pad_to=self.vocab_share)
        if _Q.search(name):
            return Cut(0, (self.q_rows(),))
        if _KV.search(name):
            return Cut(0, (self.kv_rows(),))
        if _QKV.search(name):
            q, kv = c.q_size, c.kv_size
            (a, b), (ka, kb) = self.q_rows(), self.kv_rows()
            return Cut(0, ((a, b), (q + ka, q + kb), (q + kv + ka, q + kv + kb)))
        if _O.search(name):
            return Cut(1, (self.q_rows(),))
        if _GATE_UP.search(name):
            half = shape[0] // 2
            a, b = even(half, r, n, f"{name}'s halves")
            return Cut(0, ((a, b), (half + a, half + b)))
        if _UP.search(name):
            return Cut(0, (even(shape[0], r, n, name),))
        if _DOWN.search(name):
            return Cut(1, (even(shape[1], r, n, name),))
        if _ROW_BIAS.search(name):
            return ZERO_UNLESS_RANK0
        if name.endswith(_KV_SCALES) and int(np.prod(shape)) == c.num_key_value_heads > 1:
            return Cut(0, (self.kv_head_range(),))      # one scale per KV head
        return None

    def shard(self, name: str, tensor, shapes: dict | None = None):
        """The rank's part of `tensor` (module docstring: a view where one range is cut).
        shapes: every tensor's whole shape by name (an FP8 block-scale tensor is cut as the
        weight it scales is). None: a tensor the rank does not hold (another rank's expert, a
        vision tower's off rank 0)."""
        if self.config.vision is not None and is_tower_tensor(name):
            return tensor if self.rank == 0 else None
        if self.experts is not None and (e := expert_of(name)) is not None:
            return tensor if self.experts[0] <= e < self.experts[1] else None
        if m := _HEAD_NORM.search(name):
            a, b = (self.kv_head_range() if m.group(1) == "k" else
                    (self.rank * self.heads, (self.rank + 1) * self.heads))
            return tensor if a <= int(m.group(2)) < b else None
        if name.endswith(".weight_scale_inv") and self.fp8_block is not None:
            weight = name.removesuffix("_scale_inv")
            return self.block_scales(name, tensor, self.cut(weight, tuple(shapes[weight])),
                                     self.fp8_block)
        if self.packed is not None and (
                part := self.packed.shard(self, name, tensor, shapes)) is not NotImplemented:
            return part
        cut = self.cut(name, tuple(tensor.shape))
        if cut is None:
            return tensor
        if cut == ZERO_UNLESS_RANK0:
            return tensor if self.rank == 0 else np.zeros(tensor.shape, tensor.dtype)
        if isinstance(tensor, np.ndarray):
            return cut_array(tensor, cut)
        if hasattr(tensor, "quant_parts"):
            return cut_ggml(name, tensor, cut)
        if hasattr(tensor, "take_cut"):     # read later, its rows only (a GGUF's kv_b_proj)
            return tensor.take_cut(cut)
        raise ValueError(f"tensor parallel: {name} is a {type(tensor).__name__}, which cannot "
                         "be split across ranks")

    def block_scales(self, name: str, scales, cut, block: tuple[int, int]):
        """FP8 block scales (N / bn, K / bk) cut as their weight is (`cut`), in whole blocks."""
        if cut is None or cut == ZERO_UNLESS_RANK0:
            return scales
        size = block[cut.axis]
        ranges = []
        for a, b in cut.ranges:
            if a % size or b % size:
                raise ValueError(f"tensor parallel {self.size}: fp8 {name}: the rank's "
                                 f"{'rows' if cut.axis == 0 else 'columns'} [{a}, {b}) are not "
                                 f"whole {size}-element scale blocks")
            ranges.append((a // size, b // size))
        return cut_array(scales, Cut(cut.axis, tuple(ranges)))


def ggml_block(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block of a ggml type."""
    import gguf
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]


def cut_ggml(name: str, w, cut: Cut):
    """A QuantizedWeight's rows (N) or its columns (K) in whole blocks."""
    from pyx.weights.ggml import QuantizedWeight
    if len(w.quant_parts) != 1:
        raise ValueError(f"tensor parallel: {name} mixes ggml types; it cannot be split")
    ((qtype, blocks),) = w.quant_parts
    if cut.axis == 0:
        return QuantizedWeight.of(qtype, cut_array(blocks, cut), w.k)
    elements, nbytes = ggml_block(qtype)
    ranges = []
    for a, b in cut.ranges:
        if a % elements or b % elements:
            import gguf
            raise ValueError(f"tensor parallel: GGUF {gguf.GGMLQuantizationType(qtype).name} "
                             f"{name}: the rank's columns [{a}, {b}) are not whole "
                             f"{elements}-element blocks, so it cannot be split across ranks")
        ranges.append((a // elements * nbytes, b // elements * nbytes))
    k = sum(b - a for a, b in cut.ranges)
    return QuantizedWeight.of(qtype, cut_array(blocks, Cut(1, tuple(ranges))), k)


def check_isq_split(plan: ShardPlan, weights: dict, isq: str) -> None:
    """--isq quantizes each rank's share: a row-parallel share (o_proj, down_proj: cut along K)
    must be whole blocks of the type the whole matrix would get, so that every rank quantizes
    exactly what one process would."""
    from engine.loader.isq import MARLIN, check_isq, isq_type, marlin_group, type_for
    for name, w in weights.items():
        if not isinstance(w, np.ndarray) or w.ndim != 2 or not (_O.search(name) or
                                                               _DOWN.search(name)):
            continue
        if (plan.experts is not None and expert_of(name) is not None
                or plan.config.vision is not None and is_tower_tensor(name)):
            continue            # a whole expert or tower tensor: as one process has it
        k = w.shape[1]
        if check_isq(isq) == MARLIN:
            whole, share = marlin_group(k * plan.size), marlin_group(k)
        else:
            want = isq_type(isq)
            whole, share = type_for(want, k * plan.size), type_for(want, k)
        if whole != share:
            raise ValueError(f"tensor parallel {plan.size} with --isq {isq}: {name}'s share of "
                             f"{k} columns (of {k * plan.size}) is not whole quantization blocks "
                             f"of the type the whole matrix gets, so it cannot be split")
