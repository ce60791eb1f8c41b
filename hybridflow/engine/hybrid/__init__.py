"""The hybrid engine's switch between the training and the generation view: the reshard plan, the resharder,
the rollout's own weights (a shard or, for the baseline, a broadcast copy), the stream of the trainer's
weights into a separate rollout pool (``pool_sync``), the memory account of a view and the world line.
"""
