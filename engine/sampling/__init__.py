"""From logits to tokens: sampling parameters, the sampler, logprobs, beams, grammars, pooling."""
