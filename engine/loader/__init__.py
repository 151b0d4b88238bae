"""Reading checkpoints (safetensors, GGUF, the hub), converting quantized formats, --isq."""
