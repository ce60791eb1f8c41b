"""L4: the roles (actor = training + rollout on shared weights, critic, reference) and their worker groups."""
