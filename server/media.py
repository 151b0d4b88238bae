"""Images in chat requests: content parts read, image bytes fetched and decoded, then
preprocessed for the model (engine/vision/preprocess.py), and the prompt's image tokens
expanded to each image's token count.

Parts: chat's {"type": "image_url", "image_url": {"url": ...}} (or "image_url": "..."), and the
Responses API's {"type": "input_image", "image_url": "..."}; the URL is a data URL
(data:image/png;base64,...) or, only for a host named by --allowed-media-domains, an http(s)
URL fetched here with a size and a time limit (redirects only to allowed hosts). Each image is
decoded with Pillow (any format it reads; the first frame of an animation). A request that is
wrong about an image gets a 400 naming the content part: an image sent to a text-only model,
more images than --max-images-per-request, bytes over --max-image-mb or pixels over
--max-image-pixels, a URL that is not allowed or fails, bytes Pillow cannot decode.

The chat template renders each image part as the model's image placeholder (Qwen2-VL:
<|vision_start|><|image_pad|><|vision_end|>, Mistral 3: [IMG]); tokenized, each placeholder token
is then replaced by the image's run (Qwen2-VL: the placeholder repeated to the image's token
count; Pixtral: rows of [IMG] each ended by [IMG_BREAK], the last by [IMG_END]), which is what
transformers' processor does to the text before tokenizing (the placeholder is a special token,
so its neighbours tokenize alike either way). Gemma 3's processor writes newlines around each
image, which merge with their neighbours when tokenized, so its <start_of_image> is expanded in
the rendered text instead, before tokenizing (text_expander; engine/vision/gemma3_config.py).
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from server import tokenizing
from server.protocol import APIError, image_part  # noqa: F401 (media's part reader)



@dataclass
class MediaSettings:
    allowed_domains: list[str] = field(default_factory=list)  # hosts image URLs may name
    max_images: int = 8                  # images in one request
    max_image_bytes: int = 20 * 2**20    # encoded size
    max_image_pixels: int = 25_000_000   # width x height as decoded
    fetch_timeout: float = 10.0          # seconds for one image URL


class ImagePrompt(list):
    """Prompt token ids that carry their images (engine.add_request's `images`)."""
    images: list = []


def take_images(messages: list[dict], vision) -> tuple[list[dict], list[tuple[str, str]]]:
    """(messages with each image part as {"type": "image"}, (param, url) of each image in
    template order). A text-only model (vision None) refuses any image."""
    sources, out = [], []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for part in content:
            if part.get("type") == "image" and "param" in part:
                if vision is None:
                    raise APIError("This model is text-only: image content parts are not "
                                   "supported", param=part["param"] + ".type",
                                   code="unsupported_content")
                sources.append((part["param"], part["image_url"]))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**msg, "content": parts})
    return out, sources


async def load_images(sources: list[tuple[str, str]], settings: MediaSettings, processor):
    """The images preprocessed for the model, in order; 400s as the module docstring says."""
    if len(sources) > settings.max_images:
        raise APIError(f"this request has {len(sources)} images; the server takes at most "
                       f"{settings.max_images} per request (--max-images-per-request)",
                       param=sources[settings.max_images][0], code="too_many_images")
    images = []
    for param, url in sources:
        data = await _image_bytes(url, param, settings)
        images.append(await tokenizing.run(_decode, data, param, settings, processor))
    return images


def text_expander(vision, tok, images: list | None = None):
    """For a model whose processor writes each image's tokens into the prompt text (Gemma 3:
    vision.expands_in_text), the function that does so to the rendered template; else None.
    images: the request's, in order, for the text of their pan-and-scan crops."""
    if not getattr(vision, "expands_in_text", False):
        return None

    def token_string(i):
        return tok.convert_ids_to_tokens([i])[0]
    placeholder = token_string(vision.boi_token_id)
    crops = [len(_views(im)) - 1 for im in images or []]

    def expand(text: str) -> str:
        pieces = text.split(placeholder)
        out = [pieces[0]]
        for i, piece in enumerate(pieces[1:]):
            # more placeholders than images: expand_image_tokens refuses the prompt
            out += [vision.image_text(token_string, crops[i] if i < len(crops) else 0), piece]
        return "".join(out)
    return expand


def _views(image) -> list:
    """The images the model encodes for one of the request's (Gemma 3's pan-and-scan crops
    follow their image: PanAndScanImage)."""
    return getattr(image, "views", None) or [image]


def expand_image_tokens(ids: list[int], images: list, vision) -> ImagePrompt:
    """Each image token of the rendered prompt replaced by its image's run of tokens (or, where
    the text was expanded already, each image's run of tokens checked)."""
    image_token_id = vision.image_token_id
    images = [view for im in images for view in _views(im)]
    if getattr(vision, "expands_in_text", False):
        runs = sum(1 for i, t in enumerate(ids)
                   if t == image_token_id and (i == 0 or ids[i - 1] != t))
        if runs != len(images):
            raise APIError(f"the chat template placed {runs} images for {len(images)}",
                           param="messages", code="invalid_messages")
        out = ImagePrompt(ids)
        out.images = images
        return out
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(images):
        raise APIError(f"the chat template placed {found} image tokens for {len(images)} "
                       "images", param="messages", code="invalid_messages")
    out = ImagePrompt()
    it = iter(images)
    for t in ids:
        if t == image_token_id:
            out.extend(next(it).prompt_tokens(t))
        else:
            out.append(t)
    out.images = images
    return out


async def _image_bytes(url: str, param: str, settings: MediaSettings) -> bytes:
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise APIError("an image data URL must be base64 (data:image/png;base64,...)",
                           param=param, code="invalid_image")
        if len(payload) * 3 // 4 > settings.max_image_bytes:
            raise _too_large(param, settings)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError("the image data URL is not valid base64", param=param,
                           code="invalid_image") from None
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise APIError("an image URL must be a data: URL or, where the server allows it, an "
                       "http(s) URL", param=param, code="invalid_image")
    host = _host(url)
    if host not in {d.lower() for d in settings.allowed_domains}:
        raise APIError(f"this server does not fetch images from {host or url!r}: only data: "
                       "URLs, or hosts named by --allowed-media-domains", param=param,
                       code="image_url_not_allowed")
    return await tokenizing.run(_fetch, url, param, settings)


def _host(url: str) -> str:
    return (urllib.parse.urlsplit(url).hostname or "").lower()


def _too_large(param: str, settings: MediaSettings) -> APIError:
    return APIError(f"the image is larger than this server accepts ({settings.max_image_bytes} "
                    "bytes, --max-image-mb)", param=param, code="image_too_large")


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, allowed: set[str]):
        self.allowed = allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if _host(newurl) not in self.allowed:
            raise urllib.error.URLError(f"redirected to {_host(newurl)!r}, which is not allowed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, param: str, settings: MediaSettings) -> bytes:
    """The URL's body, at most max_image_bytes, within fetch_timeout per read (a thread)."""
    opener = urllib.request.build_opener(
        _AllowedRedirects({d.lower() for d in settings.allowed_domains}))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "taper"}),
                         timeout=settings.fetch_timeout) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > settings.max_image_bytes:
                raise _too_large(param, settings)
            data = resp.read(settings.max_image_bytes + 1)
    except urllib.error.HTTPError as e:
        raise APIError(f"fetching the image failed: HTTP {e.code}", param=param,
                       code="image_fetch_failed") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise APIError(f"fetching the image failed: {reason}", param=param,
                       code="image_fetch_failed") from None
    if len(data) > settings.max_image_bytes:
        raise _too_large(param, settings)
    return data


def _decode(data: bytes, param: str, settings: MediaSettings, processor):
    from PIL import Image, UnidentifiedImageError

    from engine.vision.families import preprocess
    try:
        image = Image.open(io.BytesIO(data))
        w, h = image.size
        if w * h > settings.max_image_pixels:
            raise APIError(f"the image has {w}x{h} pixels; this server accepts at most "
                           f"{settings.max_image_pixels} (--max-image-pixels)", param=param,
                           code="image_too_large")
        image.load()
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
            Image.DecompressionBombError) as e:
        raise APIError(f"the image could not be decoded: {e}", param=param,
                       code="invalid_image") from None
    try:
        return preprocess(image, processor)
    except ValueError as e:       # an aspect ratio the processor refuses
        raise APIError(f"the image cannot be used: {e}", param=param,
                       code="invalid_image") from None
