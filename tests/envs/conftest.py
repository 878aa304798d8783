"""Fixtures for every test under tests/envs/: SmolLM2's tokenizer (``smol``, shipped, offline) and the same
tokenizer with Qwen2.5's tool chat template (``qwen``); and the code sandbox's (the python tool): ``cfg`` /
``netns`` skip where the machine has no sandbox, and ``nothing_survives`` (autouse) fails a test after which a
sandbox process of this run is still alive (defined in tests/sandbox_helpers.py)."""

import pytest

from tests.envs.test_environments import QWEN_TOOL_TEMPLATE, TOKENIZER_DIR
from tests.sandbox_helpers import cfg, netns, nothing_survives  # noqa: F401  (fixtures pytest finds here)


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.chat_template = QWEN_TOOL_TEMPLATE
    return tok
