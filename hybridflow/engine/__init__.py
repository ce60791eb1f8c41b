"""L3: per-rank compute: the FSDP2 training engine, the rollout engine and resharding."""
