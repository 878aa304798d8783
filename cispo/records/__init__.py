"""What a run writes: ``samples.jsonl`` (``samples``), the metric sinks (``tracking``) and the run
folder with its lock, resume checks and summary (``runfolder``).
"""
