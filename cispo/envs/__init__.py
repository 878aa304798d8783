"""Environments of multi-turn rollouts, above ``cispo.rollout``: one `Env` per episode (``reset`` → the
opening, ``step`` → the next observation, a turn's reward, done), the tools as one kind of environment, the
tool-call formats a policy writes, and the adapter that drives a batch of episodes through a sampler (the
sampler's ``Episodes`` protocol, ``cispo.rollout.base``; the rollout imports nothing from here).
"""
