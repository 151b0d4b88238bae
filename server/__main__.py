"""`python -m server` / `taper`: load a model and serve the OpenAI-compatible API with Hypercorn.

Flags follow candle-vllm's short names (`--w`, `--m`, `--p`, `--h`, `--mem`) with long names
beside them. With neither `--w` nor `--m`, a tiny random-weight demo checkpoint is generated
locally and served, so the API can be tried on a fresh machine without downloads.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import signal
import sys

log = logging.getLogger("taper.server")

DEMO_NAME = "taper-demo"
DEMO_WARNING = ("No model given: serving a locally generated demo checkpoint with RANDOM weights; "
                "its text is gibberish. Use --m <hub id> or --w <dir> for a real model.")


def build_parser() -> argparse.ArgumentParser:
    # add_help=False: `--h` is the host (candle-vllm's flag), so help is only `--help`.
    p = argparse.ArgumentParser(prog="taper", add_help=False, allow_abbrev=False,
                                description="Taper: serve an LLM with an OpenAI-compatible API.")
    p.add_argument("--help", action="help", help="show this help and exit")
    g = p.add_argument_group("server")
    g.add_argument("--port", "--p", dest="port", type=int, default=2000, help="port (default 2000)")
    g.add_argument("--host", "--h", dest="host", default="0.0.0.0",
                   help="address to bind (default 0.0.0.0)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) clients use for the model (default: the model's name)")
    g.add_argument("--log", action="store_true", help="verbose logging (every request)")
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--weight-path", "--w", dest="weight_path", metavar="DIR",
                     help="local checkpoint directory")
    src.add_argument("--model-id", "--m", dest="model_id", metavar="HUB_ID",
                     help="Hugging Face hub id, downloaded on first use")
    m.add_argument("--dtype", default="auto", choices=["auto", "f32", "bf16", "f16", "float32",
                                                       "bfloat16", "float16"],
                   help="weight/activation dtype (default: the checkpoint's)")
    m.add_argument("--max-model-len", type=int, metavar="N", default=None,
                   help="context length (default: the model's)")
    m.add_argument("--yarn-scaling-factor", type=float, metavar="F", default=None,
                   help="extend the context with YaRN RoPE scaling by this factor")
    e = p.add_argument_group("engine")
    e.add_argument("--cpu", action="store_true",
                   help="use the CPU backend even if a GPU is present")
    e.add_argument("--block-size", type=int, metavar="N", default=16, help="tokens per KV-cache block (8-128)")
    e.add_argument("--max-num-seqs", type=int, metavar="N", default=64, help="most sequences per step")
    e.add_argument("--max-num-batched-tokens", type=int, metavar="N", default=2048, help="token budget per step")
    e.add_argument("--kvcache-mem-gpu", "--mem", dest="kvcache_mem", type=int, default=1024,
                   metavar="MB", help="KV-cache memory in MB (default 1024)")
    e.add_argument("--prefill-chunk-size", type=int, metavar="N", default=0,
                   help="most prompt tokens per sequence per step (0: the step budget)")
    e.add_argument("--disable-prefix-cache", action="store_true",
                   help="do not reuse KV blocks across requests with a common prefix")
    e.add_argument("--seed", type=int, metavar="N", default=0, help="seed for requests that give none")
    return p


def default_backend(force_cpu: bool) -> str:
    """CUDA when our CUDA extension was built and a GPU is visible, else CPU."""
    if force_cpu or importlib.util.find_spec("pyx.cuda_backend") is None:
        return "cpu"
    try:
        import cupy
        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:       # no cupy, no driver, no device: all mean CPU
        return "cpu"


def engine_config(args):
    from engine.config import EngineConfig

    if args.weight_path:
        model = args.weight_path
    elif args.model_id:
        model = args.model_id
    else:
        from server.demo_model import ensure_demo_checkpoint
        log.warning(DEMO_WARNING)
        model = ensure_demo_checkpoint()
    return EngineConfig(
        model=model, dtype=args.dtype, backend=default_backend(args.cpu),
        block_size=args.block_size, kv_cache_memory_mb=args.kvcache_mem,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        enable_prefix_caching=not args.disable_prefix_cache, max_model_len=args.max_model_len,
        yarn_scaling_factor=args.yarn_scaling_factor, seed=args.seed)


async def serve(app, host: str, port: int, verbose: bool):
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = logging.getLogger("taper.access") if verbose else None
    config.errorlog = logging.getLogger("taper.server")
    config.graceful_timeout = 3.0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving on http://%s:%d (OpenAI API under /v1)", host, port)
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.log else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.log:
        logging.getLogger("taper.access").setLevel(logging.WARNING)
    from engine.async_engine import AsyncEngine
    from server.app import create_app

    try:
        config = engine_config(args)
    except ValueError as e:
        parser.error(str(e))
    log.info("loading %s (backend %s, dtype %s)", config.model, config.backend, config.dtype)
    try:
        engine = AsyncEngine(config)
    except (ValueError, OSError, MemoryError) as e:  # no such model, unsupported, too big...
        log.error("could not load %s: %s", config.model, e)
        return 1
    names = args.served_model_name
    if names is None and not (args.weight_path or args.model_id):
        names = [DEMO_NAME]
    try:
        app = create_app(engine, names)
        log.info("model %s ready, max_model_len %d", (names or [engine.model_name])[0],
                 engine.max_model_len)
        asyncio.run(serve(app, args.host, args.port, args.log))
    except KeyboardInterrupt:
        pass
    finally:
        log.info("shutting down")
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
