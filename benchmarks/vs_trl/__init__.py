"""Ours against TRL's ``GRPOTrainer`` on the same workload: steps/s, tokens/s, start-up."""
