"""Running a scheduled step on a backend: batch arrays, KV caches, CUDA graphs and memory."""
