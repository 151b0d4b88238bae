"""The engine's core: requests, the scheduler and KV block pool, the step pipeline."""
