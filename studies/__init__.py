"""The project's own studies: comparisons of the objective's presets and ablations over seeds, their
statistics and reports, the probes of the built-in base models, and the committed data (``results/``).

Not part of the installed library: run from the repository root (``python -m studies ...``), against the
`cispo` installed from the same commit. Nothing in `cispo` imports this package.
"""
