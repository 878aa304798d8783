"""The studies' tests (a package, so that pytest puts the repository root on ``sys.path`` and
``import studies`` works from any working directory under ``pytest``)."""
