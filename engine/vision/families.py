"""Each vision-language family's image processor and prompt layout, chosen by its vision config:
Qwen2.5-VL's and Qwen3-VL's (engine/vision/preprocess.py, inputs.py: M-RoPE), Gemma 3's
(gemma3_preprocess.py: plain RoPE, its image tokens expanded in the prompt text) or Mistral 3's
Pixtral (pixtral_preprocess.py, pixtral_inputs.py: plain RoPE, rows of image tokens with breaks)."""
from __future__ import annotations

from engine.vision.config import ImageProcessorConfig
from engine.vision.gemma3_preprocess import Gemma3ImageProcessor
from engine.vision.inputs import MultimodalPrompt
from engine.vision.pixtral_config import PixtralProcessorConfig, PixtralVisionConfig
from engine.vision.pixtral_inputs import PixtralPrompt
from engine.vision.pixtral_preprocess import preprocess_pixtral
from engine.vision.preprocess import preprocess_image


def image_processor(model_dir: str, vision):
    """The checkpoint's image processor settings."""
    if isinstance(vision, PixtralVisionConfig):
        return PixtralProcessorConfig.from_pretrained(model_dir, vision)
    if vision.architecture == "Gemma3ForConditionalGeneration":
        return Gemma3ImageProcessor.from_pretrained(model_dir, vision)
    return ImageProcessorConfig.from_pretrained(model_dir, vision)


def preprocess(image, processor):
    """A decoded PIL image -> the family's ProcessedImage (Gemma 3 with pan-and-scan on: a
    PanAndScanImage, the image's and its crops')."""
    if isinstance(processor, PixtralProcessorConfig):
        return preprocess_pixtral(image, processor)
    if isinstance(processor, Gemma3ImageProcessor):
        return processor.preprocess(image)
    return preprocess_image(image, processor)


def place_images(prompt_ids: list[int], images: list, vision) -> MultimodalPrompt:
    """The images placed at the prompt's runs of image tokens; ValueError when they differ."""
    if isinstance(vision, PixtralVisionConfig):
        return PixtralPrompt.place(prompt_ids, images, vision)
    return MultimodalPrompt.place(prompt_ids, images, vision)
