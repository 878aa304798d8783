"""The Hugging Face hub without network: a hub id is read from the local cache at once.

Without network, transformers and datasets retry each file for ~26 s before they fall back to the
cache or fail. Where the hub's host name does not resolve, cispo asks them for the cache only:
transformers by ``local_files_only=True`` (`hub_kwargs`), datasets (which has no such argument) by
its offline flag for the duration of the call (`offline_datasets`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse


@functools.cache
def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached (its host name does not resolve: no network), or None.
    ``HF_HUB_OFFLINE`` set counts as None here: the libraries already read only the cache then."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"no network: {host} does not resolve ({e.strerror or e})"
    return None


def is_remote(path) -> bool:
    """`path` names no local file or folder (so ``from_pretrained`` / ``load_dataset`` read it as a hub id)."""
    return not Path(os.path.expanduser(str(path))).exists()


def hub_kwargs(path) -> dict:
    """``{"local_files_only": True}`` for transformers' ``from_pretrained`` when `path` is a hub id and
    the hub cannot be reached (`hub_unreachable`); ``{}`` otherwise."""
    return {"local_files_only": True} if is_remote(path) and hub_unreachable() else {}


@contextlib.contextmanager
def offline_datasets(path):
    """Inside: ``datasets.load_dataset(path)`` reads only its cache when `path` is a hub id and the hub
    cannot be reached (datasets' and huggingface_hub's offline flags, restored on exit); else nothing."""
    if not (is_remote(path) and hub_unreachable()):
        yield
        return
    import datasets.config
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved
