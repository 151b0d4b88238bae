"""Images in: vision-language models' image preprocessing, vision encoders, M-RoPE positions,
the encoder-output cache and the per-step encoder budget (README: Images)."""
