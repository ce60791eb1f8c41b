"""The built-in rollout engine: KV cache, continuous batching and sampling on the trainer's own weights."""
