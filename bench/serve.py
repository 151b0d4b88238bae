"""Online serving benchmark for any OpenAI-compatible endpoint: `vllm bench serve`'s flags and JSON.

    python -m server --w DIR --p 2100 &
    python -m bench.serve --base-url http://127.0.0.1:2100 --dataset-name random \
        --random-input-len 128 --random-output-len 64 --ignore-eos --num-prompts 64 \
        --max-concurrency 4 --seed 0 --save-result --result-dir bench/.cache/serve

Prompts: vLLM's `random` dataset. Per request, an input length and an output length are drawn
uniformly within +-range_ratio of the asked ones; the prompt is a run of consecutive token ids
(special tokens left out) from a random offset, after an optional shared random prefix, decoded by
the tokenizer. Decoded text does not always re-encode to as many tokens, so the text is re-encoded
and trimmed or padded (at most 10 rounds); the reported input length is the final text's token
count as a completions server sees it (BOS included where the tokenizer adds one), or the server's
own `usage.prompt_tokens` when it reports one (as vLLM does).

Arrivals: all at once with --request-rate inf; otherwise gaps drawn from a gamma distribution of
mean 1/rate and shape --burstiness (1 = exponential gaps = a Poisson process), rescaled so the last
arrival falls at num_prompts/rate exactly (vLLM does this so that throughput does not move by the
1-2 % the sum of the random gaps would). --max-concurrency caps the requests in flight.

Per request, timed on the client with a monotonic clock from the moment the request is sent:
TTFT (first stream chunk that carries text), ITL (gaps between text chunks), E2EL (last text
chunk), TPOT = (E2EL - TTFT) / (output tokens - 1). Output tokens come from the stream's usage
chunk (`stream_options.include_usage`), or are the number of text chunks when a server sends none.
A request that fails (connection error, HTTP status other than 200, an error event, no text at
all) is listed in `errors` and left out of every figure.

HTTP is a small HTTP/1.1 client on asyncio streams (standard library only: no aiohttp, so the
bench adds no dependency), one connection per request: POST JSON, read a chunked, Content-Length
or until-close body, split the server-sent events.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import ssl
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_HEADERS = {"ttft": ("TTFT", "Time to First Token"),
                  "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                  "itl": ("ITL", "Inter-token Latency"),
                  "e2el": ("E2EL", "End-to-end Latency")}


# ---- HTTP/1.1 client

@dataclass(slots=True)
class Response:
    status: int
    reason: str
    headers: dict[str, str]           # names lower-cased
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def chunks(self):
        """The body's bytes as they arrive, de-chunked."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await self.reader.readline()
                if not size_line:
                    raise ConnectionError("connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0].strip(), 16)   # ";ext" may follow
                if size == 0:
                    while (await self.reader.readline()).strip():      # trailers, then CRLF
                        pass
                    return
                yield await self.reader.readexactly(size)
                await self.reader.readline()                          # the chunk's CRLF
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await self.reader.read(min(left, 1 << 16))
                if not data:
                    raise ConnectionError("connection closed before the end of the body")
                left -= len(data)
                yield data
        else:                                                         # HTTP/1.0 style
            while data := await self.reader.read(1 << 16):
                yield data

    async def lines(self):
        # Split bytes on b"\n" before decoding: a chunk may end inside a UTF-8 character, but
        # never inside a line break.
        buf = b""
        async for data in self.chunks():
            *done, buf = (buf + data).split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if buf:
            yield buf.rstrip(b"\r").decode("utf-8", "replace")

    async def read(self) -> bytes:
        return b"".join([d async for d in self.chunks()])

    async def close(self):
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def http_request(method: str, url: str, body: dict | None = None,
                       headers: dict[str, str] | None = None) -> Response:
    """Send one request on a fresh connection (`Connection: close`) and read the status line and
    headers; the caller reads the body from the returned Response and closes it."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    ctx = ssl.create_default_context() if u.scheme == "https" else None
    reader, writer = await asyncio.open_connection(u.hostname, port, ssl=ctx, limit=1 << 20)
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    data = b"" if body is None else json.dumps(body).encode()
    head = [f"{method} {(u.path or '/') + ('?' + u.query if u.query else '')} HTTP/1.1",
            f"Host: {host}" + (f":{u.port}" if u.port else ""),
            "User-Agent: taper-bench-serve", "Accept: */*", "Connection: close"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)
        await writer.drain()
        while True:                                    # skip 1xx interim answers
            status_line = await reader.readline()
            if not status_line:
                raise ConnectionError("the server closed the connection without answering")
            parts = status_line.decode("latin-1").strip().split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
                raise ConnectionError(f"not an HTTP response: {status_line[:100]!r}")
            resp_headers = {}
            while (line := await reader.readline()).strip():
                name, _, value = line.decode("latin-1").partition(":")
                resp_headers[name.strip().lower()] = value.strip()
            if int(parts[1]) >= 200:
                return Response(int(parts[1]), parts[2] if len(parts) > 2 else "", resp_headers,
                                reader, writer)
    except BaseException:
        writer.close()
        raise


async def get_json(url: str, headers: dict | None = None, timeout: float = 10.0):
    """GET url and parse JSON; None on any failure (used for optional probes)."""
    async def go():
        resp = await http_request("GET", url, headers=headers)
        try:
            return json.loads(await resp.read()) if resp.status == 200 else None
        finally:
            await resp.close()
    try:
        return await asyncio.wait_for(go(), timeout)
    except (OSError, ValueError, asyncio.TimeoutError):
        return None


async def sse_data(resp: Response):
    """The `data` of each server-sent event (other fields and `:` comments are skipped)."""
    data: list[str] = []
    async for line in resp.lines():
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
    if data:
        yield "\n".join(data)


# ---- one request

@dataclass(slots=True)
class RequestOutput:
    prompt_len: int
    success: bool = False
    generated_text: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


async def send_request(api_url: str, backend: str, model: str, prompt: str, prompt_len: int,
                       output_len: int, ignore_eos: bool = False, temperature: float | None = 0.0,
                       headers: dict | None = None) -> RequestOutput:
    # `max_tokens` for chat too: every OpenAI-compatible server takes it, not all take
    # `max_completion_tokens`. `ignore_eos` is a vLLM extension, sent only when asked.
    payload = {"model": model, "max_tokens": output_len, "stream": True,
               "stream_options": {"include_usage": True}}
    if backend == "openai-chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    if temperature is not None:
        payload["temperature"] = temperature
    if ignore_eos:
        payload["ignore_eos"] = True
    out = RequestOutput(prompt_len=prompt_len)
    text, num_chunks, usage = [], 0, None
    start = last = time.perf_counter()
    out.start_time = start
    try:
        resp = await http_request("POST", api_url, payload, headers)
        try:
            if resp.status != 200:
                body = (await resp.read())[:1000].decode("utf-8", "replace")
                out.error = f"HTTP {resp.status} {resp.reason}: {body}"
                return out
            async for data in sse_data(resp):
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    out.error = f"error event: {json.dumps(chunk['error'])[:1000]}"
                    return out
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if backend == "openai-chat":
                        delta = choice.get("delta") or {}
                        piece = (delta.get("content") or delta.get("reasoning_content")
                                 or delta.get("reasoning"))
                    else:
                        piece = choice.get("text")
                    if not piece:          # role-only, finish-only or empty chunks carry no token
                        continue
                    now = time.perf_counter()
                    if num_chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    num_chunks += 1
                    text.append(piece)
        finally:
            await resp.close()
    except Exception as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(text)
    if num_chunks == 0:
        out.error = "the stream carried no text, so TTFT is undefined"
        return out
    out.latency = last - start
    out.output_tokens = int(usage.get("completion_tokens") or num_chunks) if usage else num_chunks
    if usage and usage.get("prompt_tokens"):
        out.prompt_len = int(usage["prompt_tokens"])
    out.success = True
    return out


# ---- random dataset (vLLM's RandomDataset)

@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def fit_to_length(tokenizer, ids: list[int], target: int, rng, allowed: np.ndarray,
                  max_retry: int = 10) -> tuple[str, list[int]]:
    """Text whose re-encoding has `target` tokens, as near as 10 rounds of trim/pad get it."""
    for attempt in range(max_retry + 1):
        prompt = tokenizer.decode(ids)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if len(ids) == target or attempt == max_retry:
            return prompt, ids
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + allowed[rng.integers(0, len(allowed), target - len(ids))].tolist()


def sample_random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float = 0.0, prefix_len: int = 0,
                           seed: int = 0) -> list[SampleRequest]:
    """`tokenizer`: a Hugging Face tokenizer (encode, decode, vocab_size, all_special_ids)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    num_special = int(tokenizer.num_special_tokens_to_add())
    real_len = max(0, input_len - num_special)      # BOS/EOS the server adds count as input
    in_lo, in_hi = math.floor(real_len * (1 - range_ratio)), math.ceil(real_len * (1 + range_ratio))
    out_lo = max(math.floor(output_len * (1 - range_ratio)), 1)
    out_hi = max(math.ceil(output_len * (1 + range_ratio)), 1)
    if prefix_len + in_lo < 1:
        raise ValueError("--random-input-len is too small: a prompt would have no token")
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_prompts)
    allowed = np.array(sorted(set(range(tokenizer.vocab_size)) - set(tokenizer.all_special_ids)))
    prefix: list[int] = []
    if prefix_len > 0:
        _, prefix = fit_to_length(tokenizer, allowed[rng.integers(0, len(allowed), prefix_len)]
                                  .tolist(), prefix_len, rng, allowed)
    out = []
    for i in range(num_prompts):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        prompt, ids = fit_to_length(tokenizer, prefix + inner, prefix_len + int(input_lens[i]),
                                    rng, allowed)
        out.append(SampleRequest(prompt, len(ids) + num_special, int(output_lens[i])))
    return out


def load_tokenizer(name: str):
    if name.endswith(".gguf") and os.path.isfile(name):
        # the tokenizer the file carries, rebuilt as Taper's server rebuilds it for --f FILE
        from engine.loader.gguf import open_reader, read_metadata
        from engine.text.gguf_tokenizer import build_tokenizer
        tok = build_tokenizer(read_metadata(open_reader(name)), name)
        if tok is None:
            raise ValueError(f"{name} carries no tokenizer that can be rebuilt")
        return tok.hf
    from engine.text.tokenizer import Tokenizer   # transformers' fast tokenizer, never torch
    # A local directory never touches the network; a hub id may be downloaded, as vLLM does.
    return Tokenizer.from_pretrained(name, local_files_only=os.path.isdir(name)).hf


# ---- arrivals and the run

def arrival_times(n: int, request_rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> list[float]:
    """Seconds from the start at which each request is sent."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    if n == 0 or math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = rng or np.random.default_rng(0)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return (times * (n / request_rate) / times[-1]).tolist()


async def run_requests(requests: list[SampleRequest], api_url: str, backend: str, model: str, *,
                       request_rate: float = math.inf, burstiness: float = 1.0,
                       max_concurrency: int | None = None, ignore_eos: bool = False,
                       temperature: float | None = 0.0, headers: dict | None = None,
                       seed: int = 0, progress: bool = False) -> tuple[list[RequestOutput], float]:
    """Send the requests on their arrival schedule; return their outputs and the wall time."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), file=sys.stderr)

    async def one(r: SampleRequest) -> RequestOutput:
        async with limit:
            out = await send_request(api_url, backend, model, r.prompt, r.prompt_len,
                                     r.expected_output_len, ignore_eos, temperature, headers)
        if bar is not None:
            bar.update(1)
        return out

    times = arrival_times(len(requests), request_rate, burstiness, np.random.default_rng(seed))
    start = time.perf_counter()
    tasks = []
    for r, t in zip(requests, times):
        wait = start + t - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(r)))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(outputs), duration


# ---- metrics and report

def compute_metrics(outputs: list[RequestOutput], duration: float,
                    selected_metrics: list[str], percentiles: list[float]) -> dict:
    """vLLM's result keys (request_goodput stays null: no SLOs here)."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    values = {"ttft": [o.ttft for o in ok],
              "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok
                       if o.output_tokens > 1],
              "itl": [x for o in ok for x in o.itl],
              "e2el": [o.latency for o in ok]}
    res = {"duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(ok) / duration, "request_goodput": None,
           "output_throughput": total_out / duration,
           "total_token_throughput": (total_in + total_out) / duration,
           "input_lens": [o.prompt_len for o in outputs],
           "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
           "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
           "latencies": [o.latency for o in outputs],
           "generated_texts": [o.generated_text for o in outputs],
           "errors": [o.error for o in outputs]}
    for name in METRICS:
        if name not in selected_metrics:
            continue
        v = np.asarray(values[name] or [0.0]) * 1000       # vLLM reports 0 when there is none
        res[f"mean_{name}_ms"] = float(v.mean())
        res[f"median_{name}_ms"] = float(np.median(v))
        res[f"std_{name}_ms"] = float(v.std())
        for p in percentiles:
            res[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(v, p))
    return res


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "usable_cores": usable,
            "platform": platform.platform(), "python": platform.python_version()}


def print_summary(res: dict, max_concurrency: int | None, request_rate: float,
                  selected_metrics: list[str], percentiles: list[float]) -> None:
    def row(label, value, fmt="{:<10}"):
        print(("{:<40} " + fmt).format(label, value))
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate, "{:<10.2f}")
    row("Benchmark duration (s):", res["duration"], "{:<10.2f}")
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", res["output_throughput"], "{:<10.2f}")
    row("Total Token throughput (tok/s):", res["total_token_throughput"], "{:<10.2f}")
    for name in METRICS:
        if name not in selected_metrics:
            continue
        short, header = METRIC_HEADERS[name]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", res[f"mean_{name}_ms"], "{:<10.2f}")
        row(f"Median {short} (ms):", res[f"median_{name}_ms"], "{:<10.2f}")
        for p in percentiles:
            w = percentile_word(p)
            row(f"P{w} {short} (ms):", res[f"p{w}_{name}_ms"], "{:<10.2f}")
    print("{s:{c}^{n}}".format(s="Setup", n=50, c="-"))
    m = res["machine"]
    row("Client machine:", f"{m['cpu']}, {m['usable_cores']} of {m['cpu_count']} cores")
    row("Server version:", res["server_version"] or "(no /version)")
    print("=" * 50)
    for err in [e for e in res["errors"] if e][:10]:
        print("failed request:", err.splitlines()[0][:300])


# ---- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--backend", default="openai", choices=sorted(DEFAULT_ENDPOINTS),
      help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    a("--base-url", default=None, help="server base URL, e.g. http://127.0.0.1:2000")
    a("--host", default="127.0.0.1", help="used when --base-url is not given")
    a("--port", type=int, default=8000, help="used when --base-url is not given")
    a("--endpoint", default=None, help="API path (default: the backend's)")
    a("--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    a("--model", default=None, help="model name in the requests (default: the first of "
                                    "GET /v1/models)")
    a("--tokenizer", default=None, help="tokenizer directory, hub id, or GGUF file (its own "
                                        "tokenizer) for the prompts (default: --model)")
    a("--label", default=None, help="result file prefix (default: --backend)")
    a("--dataset-name", default="random", help="only 'random' is supported")
    a("--num-prompts", type=int, default=1000)
    a("--input-len", type=int, default=None, help="alias of --random-input-len")
    a("--output-len", type=int, default=None, help="alias of --random-output-len")
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--random-prefix-len", type=int, default=0)
    a("--request-rate", type=float, default=math.inf,
      help="requests per second (default inf: all at once)")
    a("--burstiness", type=float, default=1.0,
      help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more regular")
    a("--max-concurrency", type=int, nargs="+", default=None, metavar="N",
      help="most requests in flight; several values run one benchmark each and print the "
           "table of output tok/s, median TTFT and median TPOT by concurrency")
    a("--prompts-per-concurrency", type=int, default=None, metavar="K",
      help="send K x concurrency prompts at each concurrency instead of --num-prompts")
    a("--num-warmups", type=int, default=0, help="untimed requests (the first prompt) first")
    a("--seed", type=int, default=0)
    a("--ignore-eos", action="store_true", help="send ignore_eos (a vLLM extension)")
    a("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    a("--percentile-metrics", default="ttft,tpot,itl,e2el")
    a("--metric-percentiles", default="99")
    a("--save-result", action="store_true")
    a("--result-dir", default=None)
    a("--result-filename", default=None)
    a("--metadata", nargs="*", metavar="KEY=VALUE", default=None,
      help="saved in the result JSON, e.g. --metadata version=0.1 tp=1")
    a("--disable-tqdm", action="store_true")
    return p


def concurrency_table(results: list[dict]) -> str:
    """The serving table by concurrency (issue 13's): output tok/s, median TTFT, median TPOT."""
    lines = ["| concurrency | output tok/s | median TTFT | median TPOT |", "|---:|---:|---:|---:|"]
    for r in results:
        c = r["max_concurrency"] if r["max_concurrency"] is not None else "unbounded"
        lines.append(f"| {c} | {r['output_throughput']:,.0f} | {r['median_ttft_ms']:,.0f} ms | "
                     f"{r['median_tpot_ms']:.2f} ms |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict]:
    """One benchmark per --max-concurrency value (one unbounded run without it); their results."""
    if args.dataset_name != "random":
        raise SystemExit(f"bench.serve: --dataset-name {args.dataset_name!r} is not supported "
                         "(only 'random')")
    levels = args.max_concurrency or [None]
    if any(c is not None and c <= 0 for c in levels):
        raise SystemExit("bench.serve: --max-concurrency must be positive")
    if args.prompts_per_concurrency is not None and (args.prompts_per_concurrency <= 0
                                                     or levels == [None]):
        raise SystemExit("bench.serve: --prompts-per-concurrency wants a positive K and "
                         "--max-concurrency")
    metadata = {}
    for item in args.metadata or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"bench.serve: --metadata wants KEY=VALUE, got {item!r}")
        metadata[key.strip()] = value.strip()
    host = f"[{args.host}]" if ":" in args.host else args.host      # an IPv6 literal
    base_url = (args.base_url or f"http://{host}:{args.port}").rstrip("/")
    api_url = base_url + (args.endpoint or DEFAULT_ENDPOINTS[args.backend])
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    model = args.model
    if model is None:
        models = await get_json(base_url + "/v1/models", headers)
        if not models or not models.get("data"):
            raise SystemExit(f"bench.serve: no model from {base_url}/v1/models; is the server "
                             "up? (or pass --model)")
        model = models["data"][0]["id"]
        print(f"Model from the server: {model}")
    tokenizer_id = args.tokenizer or model
    try:
        tokenizer = load_tokenizer(tokenizer_id)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.serve: cannot load tokenizer {tokenizer_id!r} ({e}); "
                         "pass --tokenizer DIR") from None
    version = await get_json(base_url + "/version", headers, timeout=5.0)
    if isinstance(version, dict):
        version = version.get("version", json.dumps(version))
    results = []
    for concurrency in levels:
        results.append(await bench_one(args, concurrency, api_url, model, tokenizer,
                                       tokenizer_id, version, headers, metadata))
    if len(levels) > 1:
        print(concurrency_table(results))
    return results


async def bench_one(args: argparse.Namespace, concurrency: int | None, api_url: str,
                    model: str, tokenizer, tokenizer_id: str, version, headers: dict,
                    metadata: dict) -> dict:
    input_len = args.input_len if args.input_len is not None else args.random_input_len
    output_len = args.output_len if args.output_len is not None else args.random_output_len
    num_prompts = (args.num_prompts if args.prompts_per_concurrency is None
                   else args.prompts_per_concurrency * concurrency)
    requests = sample_random_requests(tokenizer, num_prompts, input_len, output_len,
                                      args.random_range_ratio, args.random_prefix_len, args.seed)
    print(f"#Input tokens: {sum(r.prompt_len for r in requests)}")
    print(f"#Output tokens: {sum(r.expected_output_len for r in requests)}")

    common = dict(ignore_eos=args.ignore_eos, temperature=args.temperature, headers=headers)
    if args.num_warmups > 0 and requests:
        print(f"Warming up with {args.num_warmups} requests...")
        warm, _ = await run_requests(requests[:1] * args.num_warmups, api_url, args.backend,
                                     model, max_concurrency=concurrency, **common)
        if not any(o.success for o in warm):
            raise SystemExit(f"bench.serve: the warm-up failed: {warm[0].error}")
    dist = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({dist})")
    print(f"Maximum request concurrency: {concurrency}")
    outputs, duration = await run_requests(
        requests, api_url, args.backend, model, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=concurrency, seed=args.seed,
        progress=not args.disable_tqdm, **common)

    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {"date": now, "endpoint_type": args.backend, "backend": args.backend,
              "label": args.label, "model_id": model, "tokenizer_id": tokenizer_id,
              "num_prompts": num_prompts, **metadata,
              "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
              "burstiness": args.burstiness, "max_concurrency": concurrency,
              "machine": machine_info(), "server_version": version,
              **compute_metrics(outputs, duration, selected, percentiles)}
    print_summary(result, concurrency, args.request_rate, selected, percentiles)

    if args.save_result:
        suffix = f"-concurrency{concurrency}" if concurrency is not None else ""
        name = (f"{args.label or args.backend}-{args.request_rate}qps"
                f"{suffix}-{model.split('/')[-1]}-{now}.json")
        if args.result_filename:     # several concurrencies: one file each
            stem, ext = os.path.splitext(args.result_filename)
            name = (args.result_filename if len(args.max_concurrency or [None]) == 1
                    else f"{stem}{suffix}{ext}")
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
            name = os.path.join(args.result_dir, name)
        with open(name, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"Saved {name}")
    return result


def main(argv: list[str] | None = None) -> int:
    results = asyncio.run(main_async(build_parser().parse_args(argv)))
    return 0 if all(r["completed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
