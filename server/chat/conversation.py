"""The chat client's conversation: the turns so far, the system prompt and the sampling settings
the user chose, turned into the next request and saved as JSON."""
from __future__ import annotations

import base64
import json
import mimetypes
from dataclasses import dataclass, field

# The sampling settings commands and flags change, with the type of their value. Unset ones are
# not sent, so the server's defaults (its flags, then the checkpoint's) apply.
SETTINGS = {"temperature": float, "top_p": float, "max_tokens": int}


@dataclass
class Conversation:
    system: str | None = None
    sampling: dict = field(default_factory=dict)
    turns: list[dict] = field(default_factory=list)      # user and assistant messages
    images: list[str] = field(default_factory=list)     # data URLs the next question carries

    def attach(self, path: str) -> int:
        """The image file at `path` goes with the next question (as a data URL); its size in
        bytes. OSError when it cannot be read, ValueError when it is not an image type."""
        kind = mimetypes.guess_type(path)[0]
        if kind is None or not kind.startswith("image/"):
            raise ValueError(f"{path}: not an image file (by its name)")
        with open(path, "rb") as f:
            data = f.read()
        self.images.append(f"data:{kind};base64," + base64.b64encode(data).decode("ascii"))
        return len(data)

    def messages(self) -> list[dict]:
        """What the next request sends: the system prompt (as it is now) and every turn."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def ask(self, text: str):
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()              # a question left unanswered by a second Ctrl-C
        if self.images:        # chat's content parts: the text, then the attached images
            content = [{"type": "text", "text": text}] + [
                {"type": "image_url", "image_url": {"url": url}} for url in self.images]
            self.images = []
            self.turns.append({"role": "user", "content": content})
            return
        self.turns.append({"role": "user", "content": text})

    def answered(self, text: str):
        """Keep the answer, even one stopped halfway (the user saw it); a question that got
        no answer at all is dropped, so the turns keep alternating."""
        if text:
            self.turns.append({"role": "assistant", "content": text})
        elif self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()

    def clear(self):
        self.turns.clear()

    def set(self, name: str, value: str | None):
        """Set a sampling setting from the user's text; None unsets it. ValueError says why
        the text is not a value (the server judges the range, and its 400 says so)."""
        if value is None:
            self.sampling.pop(name, None)
            return
        kind = SETTINGS[name]
        try:
            self.sampling[name] = kind(value)
        except ValueError:
            raise ValueError(f"{name} takes {'an integer' if kind is int else 'a number'}, "
                             f"not {value!r}") from None

    def save(self, path: str, model: str | None):
        """The conversation as a chat completion request body: POST it to resume."""
        body = {"model": model, "messages": self.messages(), **self.sampling}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(body, f, ensure_ascii=False, indent=2)
            f.write("\n")
