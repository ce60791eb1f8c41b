"""L2: pure tensor math for RL post-training, with verl's ``core_algos`` names."""
