"""Where one RL step's (and a run's) time and memory go: phases, the first step, rewards, log pi_old, RSS."""
