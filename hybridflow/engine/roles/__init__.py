"""The roles' computations over the training engine: the actor's log-probs and PPO-family update, the
critic's values and update, the preference (DPO/KTO) update.
"""
