"""The parallel layouts and how they are applied.

The training view (``dims.ParallelDims``) puts a role's W ranks on a (pp, tp, dp) grid (Ulysses sp groups
inside dp), built once per role from its config section, with its process groups; ``parallelize`` lays a model
out on it: pipeline stages (``pipeline``), DTensor tensor parallelism inside the layers (``tp``), Ulysses
sequence parallelism (``ulysses``), per-layer compile and FSDP2 (``fsdp``); ``grad_norm`` clips by the norm
across its meshes. The generation view splits the W ranks into W/tp rollout groups of tp ranks (``view``,
``rollout_group``). ``layout`` holds the shard rules: which slice of each weight a tensor-parallel rank holds
(the data the hybrid engine's reshard plan is computed from).
"""
