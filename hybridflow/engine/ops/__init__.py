"""What a forward pass computes with (shared by training and generation): packing, sequences, attention
kernels for packed sequences, the LM head and its kernels, dtypes, local shards, where a model's layers are.
"""
