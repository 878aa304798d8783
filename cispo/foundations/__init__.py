"""Foundations: what every layer builds on, importing no cispo module — the "did you mean" hint
(``suggest``), ``torch.distributed`` helpers, tested versions, CPU threads, plots, the NaN-skipping
mean, the batch types (``experience``), reflective (fork) strings (``forks``) and hub ids without
network (``hub``).
"""
