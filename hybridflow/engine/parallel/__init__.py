"""The parallel layouts and how they are applied.

The training view (``TrainView``) puts a role's W ranks on a (pp, tp, dp) mesh: FSDP2 over dp (``fsdp``), DTensor
tensor parallelism inside the layers over tp (``tp``), pipeline stages (``pipeline``) and Ulysses sequence
parallelism (``ulysses``); ``grad_norm`` clips by the norm across its meshes. The generation view splits the W
ranks into W/tp rollout groups of tp ranks (``view``, ``rollout_group``). ``layout`` holds the shard rules: which
slice of each weight a tensor-parallel rank holds (the data the hybrid engine's reshard plan is computed from).
"""
