"""`taper chat` / `python -m server.chat`: chat with a served model in the terminal.

A client of any OpenAI-compatible server, built on the official `openai` SDK (the API),
`prompt_toolkit` (the input line and its history) and `rich` (the answer and its reasoning
panel). It imports nothing from Taper's engine or server app.

Ctrl-C while an answer streams closes the stream (the server then aborts the request) and
returns to the prompt; Ctrl-C at the prompt clears the line; Ctrl-D or /exit leaves.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import openai
from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, InMemoryHistory
from rich.console import Console
from rich.text import Text

from server.chat.conversation import SETTINGS, Conversation
from server.chat.display import AnswerView

HELP = """\
/temperature X   sampling temperature (no value: the server's default)
/top_p X         nucleus sampling mass (no value: the server's default)
/max_tokens N    longest answer, in tokens (no value: the server's default)
/system TEXT     system prompt for the next requests (no text: none)
/image PATH      attach an image file to the next message (a vision model's)
/clear           forget the conversation
/save FILE       write the conversation as JSON (a chat completion request body)
/help            this list
/exit            leave (Ctrl-D too); Ctrl-C stops an answer"""


def default_history_path() -> str:
    """Under the user's data directory, as XDG says (~/.local/share by default)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                           "share")
    return os.path.join(base, "taper", "chat_history")


def file_history(path: str) -> FileHistory:
    """The input history kept in `path`, made if new; OSError if it cannot be."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    open(path, "a").close()
    return FileHistory(path)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="taper chat", description=(
        "Chat with a model served by Taper (or any OpenAI-compatible server) in the terminal."),
        epilog="Commands at the prompt: " + ", ".join(
            line.split()[0] for line in HELP.splitlines()) + " (/help explains them).")
    p.add_argument("--url", default="http://localhost:2000/v1",
                   help="the server's OpenAI API base URL (default http://localhost:2000/v1)")
    p.add_argument("--model", help="model to chat with (default: the first of /v1/models)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("TAPER_API_KEY")
                   or os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $TAPER_API_KEY, "
                        "else $OPENAI_API_KEY)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--temperature", type=float, metavar="X")
    p.add_argument("--top-p", dest="top_p", type=float, metavar="X")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, metavar="N")
    p.add_argument("--extra-body", type=json_object, default={}, metavar="JSON",
                   help="more request fields, e.g. vLLM's '{\"top_k\": 20, \"ignore_eos\": true}'")
    p.add_argument("--history-file", default=default_history_path(), metavar="FILE",
                   help="input history, recalled with the up arrow (default: %(default)s)")
    return p


def describe(error: openai.APIError, url: str) -> str:
    """One line saying what went wrong, with the server's own message."""
    if isinstance(error, openai.APIStatusError):
        body = error.body if isinstance(error.body, dict) else {}
        message = body.get("message") or error.response.text[:200] or error.message
        param = body.get("param")
        if param and param not in message:
            message += f" (param: {param})"
        return f"error {error.status_code} from the server: {message}"
    if isinstance(error, openai.APIConnectionError):
        cause = error.__cause__ or error
        return f"cannot reach {url}: {cause}"
    return f"the server reported an error: {error.message}"


class Chat:
    def __init__(self, args, console: Console):
        self.args, self.console = args, console
        self.client = openai.OpenAI(base_url=args.url, api_key=args.api_key or "none",
                                    max_retries=0)  # errors show at once, not after retries
        self.model: str | None = args.model
        self.listed = False               # /v1/models read (for the model's notice)
        self.notice: str | None = None
        self.notice_shown = False
        self.conversation = Conversation(system=args.system, sampling={
            name: getattr(args, name) for name in SETTINGS if getattr(args, name) is not None})

    def note(self, text: str, style: str = "dim"):
        self.console.print(Text(text, style=style), soft_wrap=True)

    def error(self, text: str):
        self.note(text, "bold red")

    def find_model(self) -> bool:
        """The first served model, unless --model named one. False (said why) if unreachable;
        asked again before the next message, so a server that was down or loading is fine.
        A model object's `notice` (Taper's random-weight demo has one) is kept to show."""
        if self.model is not None and self.listed:
            return True
        try:
            models = self.client.models.list().data
        except openai.APIError as e:
            if self.model is not None:    # named by --model: the request will say what is wrong
                self.listed = True
                return True
            self.error(describe(e, self.args.url))
            return False
        self.listed = True
        if self.model is None:
            if not models:
                self.error(f"{self.args.url}/models lists no model")
                return False
            self.model = models[0].id
        notice = next((getattr(m, "notice", None) for m in models if m.id == self.model), None)
        self.notice = notice if isinstance(notice, str) and notice else None
        return True

    def show_notice(self):
        """The model's notice, once per session."""
        if self.notice and not self.notice_shown:
            self.notice_shown = True
            self.note(f"notice: {self.notice}", "bold yellow")

    def send(self, text: str):
        if not self.find_model():
            return
        self.show_notice()
        conversation = self.conversation
        conversation.ask(text)
        view, stream, note, failure = AnswerView(self.console), None, None, None
        try:
            stream = self.client.chat.completions.create(
                model=self.model, messages=conversation.messages(), stream=True,
                extra_body=self.args.extra_body or None, **conversation.sampling)
            for chunk in stream:
                for choice in chunk.choices:
                    delta = choice.delta
                    view.add(delta.content, getattr(delta, "reasoning_content", None)
                             or getattr(delta, "reasoning", None))
                    if choice.finish_reason == "length":
                        note = "[cut at max_tokens]"
        except KeyboardInterrupt:
            note = "[stopped]"
        except openai.APIError as e:
            failure = describe(e, self.args.url)
        finally:
            if stream is not None:
                stream.close()            # a stream closed early: the server aborts the request
            view.close(note)
        if failure:
            self.error(failure)
        conversation.answered(view.answer)    # what was shown stays; no answer, no question

    def command(self, line: str) -> bool:
        """Run a /command; False to leave."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        conversation = self.conversation
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.console.print(Text(HELP))
            self.note(f"now: model {self.model}, system {conversation.system!r}, sampling "
                      f"{conversation.sampling or 'the server defaults'}")
        elif name == "/clear":
            conversation.clear()
            self.note("conversation cleared")
        elif name == "/system":
            conversation.system = arg or None
            self.note(f"system prompt: {arg}" if arg else "no system prompt")
        elif name == "/image":
            if not arg:
                self.error("usage: /image PATH")
                return True
            try:
                size = conversation.attach(os.path.expanduser(arg))
                self.note(f"image {arg} ({size} bytes) goes with the next message")
            except (OSError, ValueError) as e:
                self.error(f"could not attach: {e}")
        elif name == "/save":
            if not arg:
                self.error("usage: /save FILE")
                return True
            try:
                conversation.save(os.path.expanduser(arg), self.model)
                self.note(f"saved {len(conversation.turns)} messages to {arg}")
            except OSError as e:
                self.error(f"could not save: {e}")
        elif name[1:] in SETTINGS:
            try:
                conversation.set(name[1:], arg or None)
                self.note(f"{name[1:]}: {arg or 'the server default'}")
            except ValueError as e:
                self.error(str(e))
        else:
            self.error(f"unknown command {name}: /help lists them")
        return True

    def run(self) -> int:
        try:
            history = file_history(self.args.history_file)
        except OSError as e:
            self.error(f"input history not kept: {e}")
            history = InMemoryHistory()
        session = PromptSession(history=history)
        if self.find_model():
            self.note(f"{self.model} at {self.args.url}: /help for commands, Ctrl-D to leave")
            self.show_notice()
        while True:
            try:
                line = session.prompt("> ").strip()
            except KeyboardInterrupt:     # clears the line, as shells do
                continue
            except EOFError:
                return 0
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        return 0
                elif line:
                    self.send(line)
            except KeyboardInterrupt:     # a second Ctrl-C while an answer was being closed
                continue


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return Chat(args, Console(highlight=False)).run()
    except KeyboardInterrupt:             # Ctrl-C while connecting, before the first prompt
        return 130


if __name__ == "__main__":
    sys.exit(main())
