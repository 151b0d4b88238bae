"""The terminal chat client (`taper chat`, server/chat/) driven in a pseudo-terminal by pexpect
against a live `python -m server` on the demo checkpoint.

What the client sent is judged by the answers: the official `openai` client asks the same server
the same request, greedily, and the client's saved answer must equal it. The demo's random weights
make the alternatives answer differently, which each test shows first (sampled answers differ
from the greedy one; a system prompt changes it), so a setting that did not reach the server
fails the test. The reasoning panel is checked against the real app with a scripted engine whose
text holds <think> tags, and against the `reasoning_content` deltas vLLM streams."""
from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pexpect
import pytest

from server_fakes import ROOT, FakeEngine, LiveServer, ThreadedServer, client_for, free_port

pytestmark = pytest.mark.timeout(300)

KEY = "chat-test-key"
QUESTION = "What is two plus two?"
PROMPT = "\n> "          # the client's prompt, at the start of a line


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from server.demo_model import write_demo_checkpoint
    demo = write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))
    server = LiveServer(tmp_path_factory.mktemp("live"), demo, "--mem", "64",
                        "--served-model-name", "demo", "--api-key", KEY)
    yield server
    server.close()


def answer(live, messages, **sampling) -> tuple[str, str]:
    """The official client's answer to the same request: (text, finish_reason)."""
    client = client_for(live.port).with_options(api_key=KEY)
    choice = client.chat.completions.create(model="demo", messages=messages,
                                            **sampling).choices[0]
    return choice.message.content, choice.finish_reason


class Chat:
    """`python -m server.chat` in a pseudo-terminal. TERM=dumb: prompt_toolkit reads keys
    without drawing, rich writes plain text, so the transcript is the text itself."""

    def __init__(self, url: str, tmp_path: Path, *flags: str, api_key: str = KEY):
        env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
        env.update(TERM="dumb", LANG="C.UTF-8", XDG_DATA_HOME=str(tmp_path / "data"),
                   TAPER_API_KEY=api_key)
        self.tmp_path = tmp_path
        # SIGINT as a terminal's foreground program gets it: a test run started in the
        # background of a non-interactive shell (`cmd &`) inherits it ignored, and Ctrl-C
        # would then do nothing.
        self.proc = pexpect.spawn(sys.executable, ["-m", "server.chat", "--url", url, *flags],
                                  cwd=str(ROOT), env=env, encoding="utf-8", timeout=120,
                                  dimensions=(50, 200),
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.transcript = open(tmp_path / "transcript.txt", "a")
        self.proc.logfile_read = self.transcript
        self.proc.expect(PROMPT)

    def say(self, line: str) -> str:
        """Send a line; what was written before the next prompt, newlines as '\\n'."""
        self.proc.sendline(line)
        self.proc.expect(PROMPT)
        return self.proc.before.replace("\r", "")

    def key(self, char: str):
        """A control key or escape sequence for prompt_toolkit: sent once the prompt has put
        the terminal in raw mode (before that, the terminal itself would act on ^C or ^D)."""
        time.sleep(1.0)
        self.proc.send(char)

    def save(self) -> dict:
        path = self.tmp_path / "saved.json"
        assert "saved" in self.say(f"/save {path}")
        return json.loads(path.read_text())

    def exit(self) -> int:
        self.key("\x04")                   # Ctrl-D
        self.proc.expect(pexpect.EOF)
        self.proc.close()
        self.transcript.close()
        return self.proc.exitstatus

    def close(self):
        if self.proc.isalive():
            self.proc.terminate(force=True)
        self.transcript.close()


@pytest.fixture
def chat(live, tmp_path):
    sessions = []

    def start(*flags, url=f"http://127.0.0.1:{live.port}/v1", **kw) -> Chat:
        sessions.append(Chat(url, tmp_path, *flags, **kw))
        return sessions[-1]

    yield start
    for s in sessions:
        s.close()


def user(text):
    return {"role": "user", "content": text}


# ---- against the live server

def test_a_message_streams_an_answer_and_save_writes_the_conversation(live, chat):
    want, finish = answer(live, [user(QUESTION)], temperature=0.0, max_tokens=12)
    assert finish == "length"
    c = chat("--temperature", "0", "--max-tokens", "12")
    shown = c.say(QUESTION)
    from server.chat.display import printable
    assert printable(want) in shown and "[cut at max_tokens]" in shown
    assert c.save() == {"model": "demo", "temperature": 0.0, "max_tokens": 12,
                        "messages": [user(QUESTION), {"role": "assistant", "content": want}]}
    assert c.exit() == 0


def test_commands_change_the_next_request(live, chat):
    greedy = answer(live, [user(QUESTION)], temperature=0.0, max_tokens=10)[0]
    # what the client must send matters: sampling, or a system prompt, answers otherwise
    for seed in (1, 2):
        assert answer(live, [user(QUESTION)], temperature=1.0, seed=seed,
                      max_tokens=10)[0] != greedy
    system = {"role": "system", "content": "You answer in French."}
    with_system = answer(live, [system, user(QUESTION)], temperature=0.0, max_tokens=10)[0]
    assert with_system != greedy

    c = chat()
    for command in ("/temperature 0", "/max_tokens 10"):
        c.say(command)
    c.say(QUESTION)
    assert c.save()["messages"] == [user(QUESTION), {"role": "assistant", "content": greedy}]

    assert "conversation cleared" in c.say("/clear")
    assert c.save()["messages"] == []
    c.say("/system You answer in French.")
    c.say(QUESTION)
    assert c.save()["messages"] == [system, user(QUESTION),
                                    {"role": "assistant", "content": with_system}]

    # temperature 1 with top_p near 0 keeps only the likeliest token: the greedy answer
    for command in ("/clear", "/system", "/temperature 1", "/top_p 0.000001"):
        c.say(command)
    c.say(QUESTION)
    saved = c.save()
    assert saved["messages"] == [user(QUESTION), {"role": "assistant", "content": greedy}]
    assert (saved["temperature"], saved["top_p"], saved["max_tokens"]) == (1.0, 1e-6, 10)
    # no value: back to the server's default
    c.say("/top_p")
    assert "top_p" not in c.save()
    assert c.exit() == 0


def test_bad_values_print_a_line_and_the_client_goes_on(live, chat):
    c = chat("--max-tokens", "4")
    assert "temperature takes a number, not 'hot'" in c.say("/temperature hot")
    c.say("/temperature 7")
    shown = c.say(QUESTION)                   # the server's 400, naming the parameter
    assert re.search(r"error 400 from the server: .*temperature", shown), shown
    assert "unknown command /nope" in c.say("/nope")
    c.say("/temperature 0")
    c.say(QUESTION)
    assert c.save()["messages"][0] == user(QUESTION)   # the refused question left no turn
    assert c.exit() == 0


def metrics(live) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def running(live) -> float:
    return float(re.search(r'^taper:num_requests_running\{[^}]*\} (\S+)', metrics(live),
                           re.M).group(1))


def aborted(live) -> float:
    found = re.search(r'request_success_total\{finished_reason="abort"[^}]*\} (\S+)',
                      metrics(live))
    return float(found.group(1)) if found else 0.0


def test_ctrl_c_stops_a_long_answer_and_the_next_message_is_answered(live, chat):
    before = aborted(live)
    c = chat("--temperature", "0", "--max-tokens", "3000", "--extra-body",
             '{"ignore_eos": true}')
    c.proc.sendline("Tell me a long story.")
    c.proc.expect(r"Tell me a long story\.\r*\n")
    c.proc.expect(r".{40}")                      # the answer has started
    c.proc.sendintr()                             # Ctrl-C
    c.proc.expect(r"\[stopped\]")
    c.proc.expect(PROMPT)
    deadline = time.time() + 60                   # the closed stream aborts the request
    while aborted(live) != before + 1 or running(live) != 0:
        assert time.time() < deadline, metrics(live)
        time.sleep(0.2)

    c.say("/max_tokens 8")
    shown = c.say("Go on.")
    assert "[cut at max_tokens]" in shown
    messages = c.save()["messages"]
    partial = messages[1]["content"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert 0 < len(partial) and "[stopped]" not in partial
    # the stopped answer stays in the conversation, as the server sees it
    assert answer(live, messages[:3], temperature=0.0, max_tokens=8,
                  extra_body={"ignore_eos": True})[0] == messages[3]["content"]
    assert c.exit() == 0


def test_ctrl_c_at_the_prompt_clears_the_line_and_ctrl_d_exits_0(chat):
    c = chat()
    c.key("not sent")
    c.key("\x03")                                 # Ctrl-C
    c.proc.expect(PROMPT)
    assert c.proc.isalive()
    assert c.save()["messages"] == []
    assert c.exit() == 0


def test_up_arrow_recalls_the_history_of_an_earlier_session(chat, tmp_path):
    c = chat("--temperature", "0", "--max-tokens", "4")
    c.say("Remember this line")
    assert c.exit() == 0
    history = (tmp_path / "data" / "taper" / "chat_history").read_text()
    assert "Remember this line" in history

    c = chat("--temperature", "0", "--max-tokens", "4")
    c.key("\x1b[A")                               # up arrow, then Enter
    c.key("\r")
    c.proc.expect(PROMPT)
    assert c.save()["messages"][0] == user("Remember this line")
    assert c.exit() == 0


def test_a_wrong_api_key_prints_the_401_and_the_client_stays(chat):
    c = chat("--max-tokens", "4", api_key="wrong-key")
    banner = c.proc.before.replace("\r", "")       # written before the first prompt
    assert "error 401 from the server: Incorrect or missing API key" in banner
    shown = c.say(QUESTION)
    assert "error 401 from the server: Incorrect or missing API key" in shown
    assert c.exit() == 0


def test_the_demo_model_says_so_once(live, chat):
    c = chat("--max-tokens", "4")
    banner = c.proc.before.replace("\r", "")
    assert f"demo at http://127.0.0.1:{live.port}/v1: /help for commands" in banner
    from server.__main__ import DEMO_NOTICE
    assert f"notice: {DEMO_NOTICE}" in banner and "random weights" in DEMO_NOTICE
    assert "notice:" not in c.say(QUESTION)              # once a session
    assert c.exit() == 0
    named = chat("--model", "demo", "--max-tokens", "4")  # named by a flag, not picked: told too
    assert f"notice: {DEMO_NOTICE}" in named.proc.before
    assert named.exit() == 0


# ---- against the real app with a scripted engine

class ThinkingEngine(FakeEngine):
    """Reasoning inline, as Qwen3 and DeepSeek-R1 write it; the tags split across deltas."""
    WORDS = ["<th", "ink>", "Two and", " two", " make four.", "</", "think>", "\n\n",
             "The answer", " is 4."]


def test_think_tags_go_to_the_reasoning_panel(chat, tmp_path):
    from server.app import ServerSettings, create_app
    server = ThreadedServer(create_app(ThinkingEngine(), ServerSettings(["fake-model"])))
    try:
        c = chat("--max-tokens", str(len(ThinkingEngine.WORDS)),
                 url=f"http://127.0.0.1:{server.port}/v1")
        assert "notice:" not in c.proc.before         # a model the server says nothing of
        lines = c.say(QUESTION).splitlines()
        top = next(i for i, line in enumerate(lines) if "reasoning" in line)
        assert lines[top].startswith(("╭", "+"))
        assert re.fullmatch(r"[│|] Two and two make four\. *[│|]", lines[top + 1]), lines
        assert lines[top + 2].startswith(("╰", "+"))
        assert lines[top + 3] == "The answer is 4."
        assert c.save()["messages"][1] == {"role": "assistant", "content": "The answer is 4."}
        assert c.exit() == 0
    finally:
        server.close()


def test_the_answer_appears_as_it_is_written(chat):
    from server.app import ServerSettings, create_app
    server = ThreadedServer(create_app(FakeEngine(delay=1.0), ServerSettings(["fake-model"])))
    try:
        c = chat("--max-tokens", "5", url=f"http://127.0.0.1:{server.port}/v1")
        c.proc.sendline(QUESTION)
        c.proc.expect("Hello")                    # the first token, seconds before the last
        assert "friend" not in c.proc.buffer
        c.proc.expect_exact(" there, friend.")
        c.proc.expect(PROMPT)
        assert c.exit() == 0
    finally:
        server.close()


def test_a_loading_server_answers_503_and_then_the_client_is_served(chat):
    from server.app import ServerSettings, create_app
    app = create_app(None, ServerSettings(["fake-model"]))
    server = ThreadedServer(app)
    try:
        c = chat("--max-tokens", "5", url=f"http://127.0.0.1:{server.port}/v1")
        shown = c.say(QUESTION)
        assert "error 503 from the server: The model is still loading" in shown
        app.taper.engine = FakeEngine()           # loaded
        assert "Hello there, friend." in c.say(QUESTION)
        assert c.save()["messages"] == [user(QUESTION), {"role": "assistant",
                                                         "content": "Hello there, friend."}]
        assert c.exit() == 0
    finally:
        server.close()


# ---- reasoning as a separate field: what vLLM streams for reasoning models

REASONING_CHUNKS = [{"role": "assistant", "content": ""}, {"reasoning_content": "Two and two"},
                    {"reasoning_content": " make four."}, {"content": "The answer"},
                    {"content": " is 4."}]


class ReasoningSSE(http.server.BaseHTTPRequestHandler):
    """A server that streams chat chunks with `reasoning_content` deltas, shaped as
    OpenAI's CreateChatCompletionStreamResponse (Taper's reasoning parser is another issue)."""

    def do_GET(self):
        self._send("application/json", json.dumps({"object": "list", "data": [
            {"id": "reasoner", "object": "model", "created": 0, "owned_by": "test"}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        events = [{"id": "c1", "object": "chat.completion.chunk", "created": 0,
                   "model": "reasoner", "choices": [{"index": 0, "delta": delta,
                                                     "finish_reason": None}]}
                  for delta in REASONING_CHUNKS]
        events[-1]["choices"][0]["finish_reason"] = "stop"
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send("text/event-stream", body.encode())

    def _send(self, content_type: str, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_reasoning_content_deltas_go_to_the_reasoning_panel(chat):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), ReasoningSSE)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        c = chat(url=f"http://127.0.0.1:{server.server_address[1]}/v1")
        lines = c.say(QUESTION).splitlines()
        top = next(i for i, line in enumerate(lines) if "reasoning" in line)
        assert re.fullmatch(r"[│|] Two and two make four\. *[│|]", lines[top + 1]), lines
        assert lines[top + 3] == "The answer is 4."
        assert c.save()["messages"][1] == {"role": "assistant", "content": "The answer is 4."}
        assert c.exit() == 0
    finally:
        server.shutdown()


# ---- the <think> splitter, and the client's imports

THINKING_TEXT = "Well <think>two and two\nmake four</think>\n\nThe answer is 4. <think>again</think>!"


def whole_text_split(text: str) -> list[tuple[str, str]]:
    """The reference: split the whole text at once with a regular expression."""
    parts = re.split(r"<think>(.*?)</think>", text, flags=re.S)
    return [(("answer", "reasoning")[i % 2], p) for i, p in enumerate(parts) if p]


def merged(pieces):
    out = []
    for kind, text in pieces:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


def test_think_splitter_finds_tags_however_the_stream_is_cut():
    from server.chat.display import ThinkSplitter
    want = whole_text_split(THINKING_TEXT)
    assert [kind for kind, _ in want] == ["answer", "reasoning", "answer", "reasoning", "answer"]
    n = len(THINKING_TEXT)
    for i in range(n + 1):
        for j in range(i, n + 1, 3):
            splitter = ThinkSplitter()
            pieces = []
            for delta in (THINKING_TEXT[:i], THINKING_TEXT[i:j], THINKING_TEXT[j:]):
                pieces += splitter.feed(delta)
            pieces += splitter.flush()
            assert merged(pieces) == want, (i, j)
    # text that only looks like the start of a tag comes out at the end
    splitter = ThinkSplitter()
    assert splitter.feed("a <thi") == [("answer", "a ")]
    assert splitter.feed("s") == [("answer", "<this")]
    assert splitter.feed("<") == [] and splitter.flush() == [("answer", "<")]


def test_the_client_imports_neither_the_engine_nor_the_server_app():
    import subprocess
    code = ("import sys\nfrom server.__main__ import main\ntry:\n    main(['chat', '--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'engine', 'pyx', 'quart', 'hypercorn', 'jinja2', 'torch'}), "
            "'server.app' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "usage: taper chat" in out and "--extra-body JSON" in out
    assert out.splitlines()[-1] == "[] False"
