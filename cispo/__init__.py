"""cispo: CISPO (MiniMax-M1, arXiv 2506.13585, section 3) and its family as one RL objective."""

__version__ = "0.1.0"
