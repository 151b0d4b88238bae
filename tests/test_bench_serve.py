"""bench/serve.py against a stub OpenAI streaming server on loopback (asyncio, no model).

The stub streams `max_tokens` text chunks (each SSE event split over two HTTP chunks, the tail
events packed into one, so the client's de-chunking and event splitting are exercised), records
when each request arrived and how many were in flight, and can drop the usage chunk or answer
some requests with HTTP 500.
"""
import asyncio
import json
import math
import time

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from bench import serve
from server.demo_model import build_tokenizer

TOKEN_DELAY = 0.002


class Stub:
    def __init__(self, usage=True, fail_every=0, prompt_tokens=None):
        self.usage, self.fail_every, self.prompt_tokens = usage, fail_every, prompt_tokens
        self.arrivals: list[float] = []
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.active = self.max_active = 0

    async def start(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self):
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, reader, writer):
        method, path, _ = (await reader.readline()).decode().split(" ", 2)
        headers = {}
        while (line := await reader.readline()).strip():
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        if method == "GET" and path == "/v1/models":
            self.send_json(writer, 200, {"object": "list", "data": [{"id": "stub-model"}]})
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self.stream(writer, json.loads(body), headers, chat="chat" in path)
        else:
            self.send_json(writer, 404, {"error": {"message": "not found"}})
        await writer.drain()
        writer.close()

    def send_json(self, writer, status, obj):
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    async def stream(self, writer, body, headers, chat):
        index = len(self.arrivals)
        self.arrivals.append(time.perf_counter())
        self.bodies.append(body)
        self.headers.append(headers)
        if self.fail_every and index % self.fail_every == 1:
            self.send_json(writer, 500, {"error": {"message": "stub failure"}})
            return
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")

        def event(choice=None, usage=None):
            obj = {"id": "x", "choices": [choice] if choice else [], "usage": usage}
            return f"data: {json.dumps(obj)}\n\n".encode()

        def chunk(data):
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        def token(text, finish=None):
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {},
                        "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        n = body["max_tokens"]
        if chat:   # a role-only first chunk carries no token
            chunk(event({"index": 0, "delta": {"role": "assistant", "content": ""}}))
        for i in range(n):
            e = event(token(f" t{i}"))
            chunk(e[:7])                  # an event split across HTTP chunks
            chunk(e[7:])
            await writer.drain()
            await asyncio.sleep(TOKEN_DELAY)
        tail = event(token("", "length"))
        if self.usage:
            tail += event(usage={"prompt_tokens": self.prompt_tokens, "completion_tokens": n})
        chunk(tail + b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        self.active -= 1


def run_with_stub(stub, coro_fn):
    async def go():
        url = await stub.start()
        try:
            return await coro_fn(url)
        finally:
            await stub.close()
    return asyncio.run(go())


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(),
                            eos_token="<|im_end|>").save_pretrained(d)
    return str(d)


REQUIRED_KEYS = {"date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                 "burstiness", "max_concurrency", "duration", "completed",
                 "total_input_tokens", "total_output_tokens", "request_throughput",
                 "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
                 "output_lens", "ttfts", "itls", "generated_texts", "errors"}


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_end_to_end_counts_and_json(tmp_path, tok_dir, backend):
    stub = Stub(prompt_tokens=17)
    args = ["--backend", backend, "--tokenizer", tok_dir, "--dataset-name", "random",
            "--random-input-len", "16", "--random-output-len", "5", "--num-prompts", "6",
            "--max-concurrency", "2", "--ignore-eos", "--api-key", "sk-test",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
            "--metadata", "run=unit", "--metric-percentiles", "50,99.9", "--disable-tqdm"]

    async def go(url):
        return await serve.main_async(serve.build_parser().parse_args(args + ["--base-url", url]))
    [res] = run_with_stub(stub, go)

    saved = json.loads((tmp_path / "r.json").read_text())
    assert REQUIRED_KEYS <= saved.keys()
    for m in serve.METRICS:
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{m}_ms" in saved
    assert saved["run"] == "unit" and saved["request_rate"] == "inf"
    assert saved["model_id"] == "stub-model" and saved["request_goodput"] is None
    assert res["completed"] == 6 and res["failed"] == 0 and res["errors"] == [""] * 6
    assert res["output_lens"] == [5] * 6 and res["total_output_tokens"] == 30
    assert res["input_lens"] == [17] * 6          # the server's usage.prompt_tokens wins
    assert all(len(itl) == 4 for itl in res["itls"])
    assert res["generated_texts"][0] == " t0 t1 t2 t3 t4"
    assert all(t > 0 for t in res["ttfts"]) and res["mean_itl_ms"] >= TOKEN_DELAY * 1000 * 0.9
    assert res["mean_tpot_ms"] == pytest.approx(
        np.mean([(lat - t) / 4 * 1000 for lat, t in zip(res["latencies"], res["ttfts"])]))
    assert stub.max_active == 2
    body = stub.bodies[0]
    assert body["model"] == "stub-model" and body["max_tokens"] == 5 and body["stream"]
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert ("messages" in body) == (backend == "openai-chat")
    assert stub.headers[0]["authorization"] == "Bearer sk-test"


def test_several_concurrencies_print_the_table(tmp_path, tok_dir, capsys):
    stub = Stub()
    args = ["--tokenizer", tok_dir, "--random-input-len", "16", "--random-output-len", "6",
            "--max-concurrency", "1", "4", "--prompts-per-concurrency", "2", "--ignore-eos",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
            "--disable-tqdm"]

    async def go(url):
        return await serve.main_async(serve.build_parser().parse_args(args + ["--base-url", url]))
    results = run_with_stub(stub, go)

    assert [r["max_concurrency"] for r in results] == [1, 4]
    assert [r["num_prompts"] for r in results] == [2, 8] and stub.max_active == 4
    assert [r["completed"] for r in results] == [2, 8]
    for r, c in zip(results, (1, 4)):
        assert json.loads((tmp_path / f"r-concurrency{c}.json").read_text())["num_prompts"] == 2 * c
    table = capsys.readouterr().out.split("| concurrency |", 1)[1].splitlines()
    assert table[0] == " output tok/s | median TTFT | median TPOT |"
    assert table[1] == "|---:|---:|---:|---:|"
    for line, r in zip(table[2:4], results):
        tpot = np.median([(lat - t) / 5 for lat, t in zip(r["latencies"], r["ttfts"])]) * 1000
        ttft = np.median(r["ttfts"]) * 1000
        assert line == (f"| {r['max_concurrency']} | "
                        f"{r['total_output_tokens'] / r['duration']:,.0f} | {ttft:,.0f} ms | "
                        f"{tpot:.2f} ms |")


def test_without_usage_counts_chunks_and_failures_are_left_out():
    stub = Stub(usage=False, fail_every=3)
    reqs = [serve.SampleRequest(f"p{i}", 10 + i, 4) for i in range(6)]

    async def go(url):
        return await serve.run_requests(reqs, url + "/v1/completions", "openai", "m",
                                        max_concurrency=1)
    outputs, duration = run_with_stub(stub, go)
    ok = [o.success for o in outputs]
    assert ok == [True, False, True, True, False, True]
    assert all("HTTP 500" in o.error for o in outputs if not o.success)
    res = serve.compute_metrics(outputs, duration, list(serve.METRICS), [99])
    assert res["completed"] == 4 and res["failed"] == 2
    assert res["output_lens"] == [4, 0, 4, 4, 0, 4] and res["total_output_tokens"] == 16
    assert res["total_input_tokens"] == 10 + 12 + 13 + 15   # local counts: no usage chunk


def test_rate_inf_sends_all_at_once_and_concurrency_1_serialises():
    reqs = [serve.SampleRequest("p", 1, 5) for _ in range(8)]

    def run(max_concurrency):
        stub = Stub()

        async def go(url):
            return await serve.run_requests(reqs, url + "/v1/completions", "openai", "m",
                                            max_concurrency=max_concurrency)
        outputs, _ = run_with_stub(stub, go)
        assert all(o.success for o in outputs)
        return stub, outputs

    stub, _ = run(None)
    assert stub.max_active == 8
    assert max(stub.arrivals) - min(stub.arrivals) < 5 * TOKEN_DELAY   # well before one finishes
    stub, outputs = run(1)
    assert stub.max_active == 1
    # each request is sent only after the previous one's stream ended
    ends = sorted(o.start_time + o.latency for o in outputs)
    starts = sorted(o.start_time for o in outputs)
    assert all(s >= e for s, e in zip(starts[1:], ends[:-1]))


def test_finite_rate_spreads_arrivals_over_n_over_rate():
    stub = Stub()
    reqs = [serve.SampleRequest("p", 1, 1) for _ in range(8)]

    async def go(url):
        t0 = time.perf_counter()
        outputs, _ = await serve.run_requests(reqs, url + "/v1/completions", "openai", "m",
                                              request_rate=40.0, seed=3)
        return t0, outputs
    t0, outputs = run_with_stub(stub, go)
    assert max(o.start_time for o in outputs) - t0 == pytest.approx(8 / 40, abs=0.03)
    assert np.all(np.diff(stub.arrivals) >= 0)


def test_arrival_times():
    assert serve.arrival_times(5, math.inf) == [0.0] * 5
    assert np.allclose(np.diff([0.0] + serve.arrival_times(4, 2.0, math.inf)), 0.5)
    n, rate = 20000, 10.0
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):
        t = np.array(serve.arrival_times(n, rate, burstiness, np.random.default_rng(0)))
        gaps = np.diff(np.concatenate([[0.0], t]))
        assert t[-1] == pytest.approx(n / rate) and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)   # gamma: CV = 1/sqrt(k)
    a = serve.arrival_times(10, 5.0, 1.0, np.random.default_rng(1))
    assert a == serve.arrival_times(10, 5.0, 1.0, np.random.default_rng(1))
    assert a != serve.arrival_times(10, 5.0, 1.0, np.random.default_rng(2))


def test_random_dataset_lengths_are_re_encoded_counts(bl):
    hf = bl.hf                                     # byte-level BPE that adds BOS
    assert hf.num_special_tokens_to_add() == 1
    reqs = serve.sample_random_requests(hf, 6, 24, 8, range_ratio=0.5, prefix_len=3, seed=1)
    for r in reqs:
        ids = hf.encode(r.prompt)
        assert r.prompt_len == len(ids)           # BOS counted, as a completions server does
        assert not set(ids[1:]) & set(hf.all_special_ids)
        assert 4 <= r.expected_output_len <= 12
    again = serve.sample_random_requests(hf, 6, 24, 8, range_ratio=0.5, prefix_len=3, seed=1)
    other = serve.sample_random_requests(hf, 6, 24, 8, range_ratio=0.5, prefix_len=3, seed=2)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    assert [r.prompt for r in other] != [r.prompt for r in reqs]


def test_a_gguf_file_as_tokenizer_is_the_tokenizer_it_carries(tmp_path):
    """--tokenizer FILE.gguf (bench.serve_vs_llamacpp --gguf): the prompts come from the file's
    own tokenizer, so their lengths are the ones the server (--f FILE) counts."""
    import os
    from gguf import GGUFReader
    from engine.loader.gguf import read_metadata
    from engine.text.gguf_tokenizer import build_tokenizer as gguf_tokenizer
    from gguf_fixtures import HERE, load_script, path_of
    path = path_of("qwen2-f32")
    hf = serve.load_tokenizer(path)
    ours = gguf_tokenizer(read_metadata(GGUFReader(path)), path)
    assert hf.get_vocab() == ours.hf.get_vocab() and hf.vocab_size == ours.hf.vocab_size
    for r in serve.sample_random_requests(hf, 4, 20, 8, seed=3):
        assert len(ours.encode(r.prompt)) == r.prompt_len
    maker = load_script(os.path.join(HERE, "data", "make_gguf_fixtures.py"))
    bad = maker.pre_variant(path, str(tmp_path / "made-up.gguf"), "made-up")
    with pytest.raises(ValueError, match="made-up.gguf carries no tokenizer"):
        serve.load_tokenizer(bad)


def test_only_the_random_dataset():
    args = serve.build_parser().parse_args(["--dataset-name", "sharegpt", "--model", "m"])
    with pytest.raises(SystemExit, match="only 'random'"):
        asyncio.run(serve.main_async(args))


def test_serve_check_passes_against_a_real_server_and_fails_on_failed_requests(tmp_path):
    """bench.serve_check (the GPU_SUITE=serve step) end to end on the CPU with the demo
    checkpoint: it starts `python -m server`, streams through the openai client, runs bench.serve,
    checks /metrics and writes the table. With --max-model-len between the chat's length and the
    benchmark's, every benchmark request is refused, and the check must fail."""
    import socket
    import subprocess
    import sys

    from server.demo_model import ensure_demo_checkpoint

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def run(*extra):
        out = tmp_path / f"out{len(extra)}"
        cmd = [sys.executable, "-m", "bench.serve_check", "--model", ensure_demo_checkpoint(),
               "--out", str(out), "--port", str(free_port()), "--server-arg=--cpu",
               "--concurrency", "1", "2", "--prompts-per-client", "2", "--input-len", "48",
               "--output-len", "8", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600), out

    done, out = run()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "streamed chat:" in done.stdout and "taper:kv_cache_usage_perc 0" in done.stdout
    rows = (out / "serve_table.md").read_text().splitlines()[2:]
    assert [r.split("|")[1:3] for r in rows] == [[" 1 ", " 8 "], [" 2 ", " 4 "]]
    done, _ = run("--server-arg=--max-model-len=48")
    assert done.returncode != 0
    assert "FAILED: concurrency 1: 8 of 8 requests failed" in done.stdout
