"""The training engine (optimizer, LR schedule, clipping, offload between phases), micro-batches and the
scorers that turn a packed batch into log-probs or values.
"""
