"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the verification of
their drafts by the target (rejection sampling), and the per-sequence policy (engine/spec/speculator.py
ties them to the step pipeline)."""
