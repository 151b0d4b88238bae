"""A vision checkpoint's image processor, by family: read from its directory, and applied to a
decoded image (the server's media.py holds it as one object either way)."""
from __future__ import annotations

from engine.vision.config import ImageProcessorConfig
from engine.vision.gemma3_preprocess import Gemma3ImageProcessor
from engine.vision.preprocess import ProcessedImage, preprocess_image


def load_image_processor(model_dir: str, vision):
    """The checkpoint's processor settings for its vision tower (vision: ModelConfig.vision)."""
    if vision.architecture == "Gemma3ForConditionalGeneration":
        return Gemma3ImageProcessor.from_pretrained(model_dir, vision)
    return ImageProcessorConfig.from_pretrained(model_dir, vision)


def preprocess(image, processor) -> ProcessedImage:
    """A decoded PIL image -> the vision tower's input, by `processor`'s family."""
    if isinstance(processor, ImageProcessorConfig):
        return preprocess_image(image, processor)
    return processor.preprocess(image)
