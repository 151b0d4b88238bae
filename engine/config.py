"""Engine configuration: what to load, on which backend, and how large the KV pool is."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.lora.config import LoraConfig
from engine.runner.backends import detect_backend
from engine.spec.config import SpeculativeConfig
from pyx.kernel_config import KernelConfig


@dataclass(slots=True)
class EngineConfig:
    model: str                           # a local directory or a Hugging Face hub id
    weight_file: str | None = None       # a GGUF file: a path, or a name in `model` (dir or hub)
    mmproj: str | None = None            # llama.cpp's vision projector beside a GGUF weight_file
    dtype: str = "auto"                  # auto (the checkpoint's) | f32 | bf16 | f16
    backend: str = "auto"                # auto (CUDA where a device is visible) | cpu | cuda
    device: int = 0                      # the CUDA device index
    # Tensor parallel (engine/parallel/): the model split across this many processes, rank 0 this
    # one; on CUDA rank r uses device_ids[r] (default: device + r).
    tensor_parallel_size: int = 1
    # Expert parallel (vLLM's --enable-expert-parallel): a MoE model's tensor-parallel ranks each
    # hold E / tensor_parallel_size whole experts instead of a slice of every expert.
    enable_expert_parallel: bool = False
    # Pipeline parallel (engine/parallel/pipeline.py): the layers split into this many stages,
    # each stage tensor_parallel_size processes; a step's sequences run through the stages in
    # pipeline_micro_batches micro-batches (0: twice the stages where the step has 64 tokens
    # a micro-batch, fewer where it has not: engine/parallel/pipeline.py says why).
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int = 0
    # Data parallel (engine/parallel/data_parallel.py, the API server only): this many engine
    # replicas, each a process with the whole model (split as the sizes above say).
    data_parallel_size: int = 1
    # How the ranks above start: "mp" processes MPI spawns on this machine, "ray" Ray actors
    # placed over a Ray cluster (engine/parallel/ray_executor.py).
    distributed_executor: str = "mp"
    device_ids: tuple[int, ...] = ()
    cuda_graph: bool = True              # capture decode steps in CUDA graphs (CUDA backend)
    block_size: int = 16                 # tokens per KV block, a power of two in [8, 128]
    num_kv_blocks: int | None = None     # explicit pool size; else from the two below
    kv_cache_memory_mb: int | None = None  # KV pool size in MB; wins over kv_fraction
    kv_fraction: float | None = None     # else this fraction of the memory free after loading
    kv_cache_dtype: str = "auto"         # auto: the backend's (f32 on CPU); fp8: e4m3 codes
    max_num_seqs: int | None = None      # None: sized from the KV pool (max_num_seqs.py)
    max_num_batched_tokens: int = 2048   # per-step token budget
    prefill_chunk_size: int = 0          # max prompt tokens per sequence per step; 0 = budget only
    enable_prefix_caching: bool = True
    prefix_cache_max_tokens: int | None = None  # most tokens the prefix cache keeps hashed
    state_snapshots: int | None = None   # hybrid models: prefix-cache state snapshots (None: one
                                         # per state slot; engine/core/hybrid_state.py)
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    yarn_scaling_factor: float | None = None
    isq: str | None = None               # quantize projections at load: q4_0 ... q6k, marlin
    tokenizer: str | None = None         # default: the model directory
    seed: int = 0                        # seeds per-request seeds when a request gives none
    batch_invariant: bool = False        # CPU: a request's logits are the same bits in any batch
    logprobs_mode: str = "raw"           # raw: of the model's logits; processed: as sampled
    async_scheduling: bool = True        # prepare step N+1 while step N runs (LLMEngine.step)
    schedule_ahead: bool = True          # ... and schedule it before N's tokens are known
    # Kernel choices (pyx/kernel_config.py): a KernelConfig, or a "prefill=fa2,decode=split"
    # string or a dict, made a KernelConfig here (--kernels, LLM(kernels=...)).
    kernels: KernelConfig = field(default_factory=KernelConfig)
    # Speculative decoding (engine/spec/): a SpeculativeConfig, or its JSON text or dict
    # (--speculative-config, vLLM's keys); None: off.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters per request (engine/lora/, --enable-lora): a LoraConfig, or a dict of its
    # fields; None: off.
    lora: LoraConfig | None = None

    @property
    def world_size(self) -> int:
        """The processes (ranks) the model is split across."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self):
        self.kernels = KernelConfig.parse(self.kernels)
        if isinstance(self.lora, dict):
            self.lora = LoraConfig(**self.lora)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.block_size < 8 or self.block_size > 128 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [8, 128], got {self.block_size}")
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend must be auto, cpu or cuda, got {self.backend!r}")
        if self.backend == "auto":
            self.backend = detect_backend()
        if self.device < 0:
            raise ValueError(f"device must be >= 0, got {self.device}")
        self.device_ids = tuple(self.device_ids)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got "
                             f"{self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got "
                             f"{self.pipeline_parallel_size}")
        if self.distributed_executor not in ("mp", "ray"):
            raise ValueError(f"distributed_executor must be mp or ray, got "
                             f"{self.distributed_executor!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got "
                             f"{self.data_parallel_size}")
        if self.pipeline_micro_batches < 0:
            raise ValueError("pipeline_micro_batches must be >= 0 (0: automatic)")
        if self.device_ids and len(self.device_ids) != self.world_size:
            raise ValueError(f"device_ids {list(self.device_ids)} name {len(self.device_ids)} "
                             f"devices for tensor_parallel_size {self.tensor_parallel_size} x "
                             f"pipeline_parallel_size {self.pipeline_parallel_size}")
        if self.dtype not in ("auto", "f32", "bf16", "f16", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, f32, bf16 or f16, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_num_seqs is not None and self.max_num_seqs > self.max_num_batched_tokens:
            # Decodes are scheduled first, one token each: a budget below the sequence count
            # would leave some running sequences without a token, and prefills without any.
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be at most "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb < 1:
            raise ValueError("kv_cache_memory_mb must be at least 1")
        if self.kv_fraction is not None and not 0.0 < self.kv_fraction <= 1.0:
            raise ValueError(f"kv_fraction must be in (0, 1], got {self.kv_fraction}")
        if self.kv_cache_dtype not in ("auto", "bf16", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto, bf16 or fp8, got {self.kv_cache_dtype!r}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError("state_snapshots must be >= 0")
        if self.prefix_cache_max_tokens is not None and self.prefix_cache_max_tokens < 0:
            raise ValueError("prefix_cache_max_tokens must be >= 0")
        if self.isq is not None:   # imported here so that `import engine` loads no extension
            from engine.loader.isq import check_isq
            check_isq(self.isq)
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be raw or processed, got {self.logprobs_mode!r}")
        if self.prefill_chunk_size < 0:
            raise ValueError("prefill_chunk_size must be >= 0 (0 = off)")
        if self.batch_invariant and self.backend != "cpu":
            raise ValueError("batch_invariant is implemented on the CPU backend only: the CUDA "
                             "kernels (cuBLAS GEMMs, split-K decode attention) reduce in an "
                             "order that depends on the batch")
