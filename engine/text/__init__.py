"""Text in and out: tokenizers (Hugging Face and GGUF) and incremental detokenization."""
