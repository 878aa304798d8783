"""The GPU readiness check (``gpu_check.py``) and its sections; runs on a bare CUDA image."""
