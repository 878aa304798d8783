"""The benchmarks, grouped by the question each answers (benchmarks/README.md has the table).

Not installed with cispo. Each script runs as ``python benchmarks/<group>/<name>.py`` from anywhere:
its first import line puts the repository root on ``sys.path``, so the shared helpers import by their
full name (``benchmarks._common``, ``benchmarks.vs_trl._trl_common``, ``benchmarks.gpu._gpu_common``)
and the cispo measured is this checkout's, installed or not.
"""
