"""A reward model as a reward: ``data.reward=rm:<folder>``.

    >>> rm = load_reward_model("rm:path/to/reward_model")      # an AutoModelForSequenceClassification folder
    >>> rm.score_batch([(prompt, completion, sample), ...])     # [Outcome, ...], batched

The folder holds a Hugging Face ``AutoModelForSequenceClassification`` checkpoint and its tokenizer
(the text scored: `RewardModel.text`). The reward of a completion is the model's logit on prompt +
completion: a 1-label head's one logit; with 2 or more labels the logit of label 0 (``id2label[0]``),
the one TRL's GRPOTrainer takes (``logits[:, 0]``) — for another label, a probability or a margin,
load the model in a function reward of your own.

It runs in the trainer's process, never in the reward worker processes (`cispo.data.rewards.pool`):
each worker would load its own copy of the weights and score one completion per call, while here
the whole batch goes through the model in `BATCH_SIZE` rows at a time, on this process's GPU when
it has one (``torch.cuda.current_device()``, the rank's own under torchrun), else on the CPU.
``data.reward_isolation``, ``data.reward_workers`` and ``data.reward_timeout_s`` therefore do not
apply to it; an exception in its forward (out of memory) fails that chunk's calls (each scores 0
and is counted in ``rollout/reward_errors``), as a failing reward's calls do.
"""

from __future__ import annotations

from pathlib import Path

from cispo.data.rewards import Outcome, RewardSpecError, check_reward_value, describe_error

__all__ = ["RewardModel", "load_reward_model", "BATCH_SIZE", "REWARD_MODEL_PREFIX"]

REWARD_MODEL_PREFIX = "rm:"
"""``data.reward=rm:<folder>``: a reward model."""

BATCH_SIZE = 16
"""Completions per forward pass of a reward model."""


class RewardModel:
    """A loaded reward model: `score_batch` for a batch, or called as cispo's
    ``(prompt, completion, **sample) -> float`` for one completion."""

    isolated = False
    """Never in worker processes (the module docstring)."""
    binary = False
    """A score, not a 0/1 verdict: its mean is no accuracy."""

    def __init__(self, spec: str, model, tokenizer) -> None:
        self.spec, self.model, self.tokenizer = spec, model, tokenizer

    @property
    def name(self) -> str:
        """The folder's name (``rollout/rewards/<name>/...``), as TRL names a reward model by the last
        part of its id."""
        return Path(self.spec[len(REWARD_MODEL_PREFIX):]).name or "reward_model"

    def text(self, prompt: str, completion: str, sample: dict) -> str:
        """What the model reads: for chat data (the sample has ``messages``) and a tokenizer with a chat
        template, the messages and the completion as the assistant's reply through that template (TRL's
        conversational case); else ``prompt + completion``."""
        messages = sample.get("messages")
        if messages and getattr(self.tokenizer, "chat_template", None):
            reply = {"role": "assistant", "content": completion}
            return self.tokenizer.apply_chat_template(list(messages) + [reply], tokenize=False)
        return prompt + completion

    def logits(self, texts: list[str]) -> list[float]:
        """The score of each text: label 0's logit, one forward pass (right-padded, no special tokens
        added, as TRL; a text longer than the model's context is cut at its start, keeping the end
        the score is read at)."""
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.model.device != device:
            self.model.to(device)
        limit = getattr(self.model.config, "max_position_embeddings", None)
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False,
                             truncation=limit is not None, max_length=limit)
        with torch.inference_mode():
            logits = self.model(**enc.to(device)).logits  # [b, num_labels]
        return logits[:, 0].float().tolist()

    def score_batch(self, calls: list) -> list[Outcome]:
        """The `Outcome` of each of ``calls = [(prompt, completion, sample), ...]``, `BATCH_SIZE` at a
        time; a chunk whose forward raises fails its calls (0.0 and the message), a non-finite logit
        fails its own."""
        out = []
        for start in range(0, len(calls), BATCH_SIZE):
            chunk = calls[start:start + BATCH_SIZE]
            try:
                values = self.logits([self.text(p, c, s) for p, c, s in chunk])
            except Exception as e:  # noqa: BLE001 - a reward must never take the run down
                out += [Outcome(0.0, f"reward model {self.name!r}: {describe_error(e)}")] * len(chunk)
                continue
            for value in values:
                try:
                    out.append(Outcome(check_reward_value(value), None))
                except ValueError as e:
                    out.append(Outcome(0.0, f"reward model {self.name!r}: {describe_error(e)}"))
        return out

    def __call__(self, prompt: str, completion: str, /, **sample) -> float:
        return self.logits([self.text(prompt, completion, sample)])[0]


def load_reward_model(spec: str) -> RewardModel:
    """The reward model of ``spec`` = ``rm:<folder>`` (a local folder, or a hub id from_pretrained
    finds): its weights (in their saved dtype) and tokenizer, in eval mode without gradients, with a
    padding token (the EOS when it has none; the model's ``pad_token_id`` set to it, which sequence
    classification uses to find each row's last token). A missing folder, one that is not a
    sequence-classification checkpoint, or one whose classification head is not in the folder (a
    causal LM's: the head would be random) -> `RewardSpecError` naming it."""
    target = spec[len(REWARD_MODEL_PREFIX):].strip()
    if not target:
        raise RewardSpecError(f"reward {spec!r}: name the reward model's folder, rm:path/to/folder")
    path = Path(target).expanduser()
    if (path.exists() or target.startswith((".", "/", "~"))) and not (path / "config.json").is_file():
        raise RewardSpecError(f"reward {spec!r}: {str(path)!r} is no model folder (no config.json in it); "
                              f"rm: takes an AutoModelForSequenceClassification folder")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(target, dtype="auto", output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(target)
    except Exception as e:  # noqa: BLE001 - any failure to load is one line naming the folder
        raise RewardSpecError(f"reward {spec!r}: cannot load a sequence-classification model and tokenizer "
                              f"from {target!r}: {describe_error(e)}") from None
    if info.get("missing_keys"):
        missing = ", ".join(sorted(info["missing_keys"])[:3])
        raise RewardSpecError(f"reward {spec!r}: {target!r} holds no trained classification head (not in the folder: "
                              f"{missing}); rm: takes a reward model saved as AutoModelForSequenceClassification")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token is None:
        raise RewardSpecError(f"reward {spec!r}: the tokenizer in {target!r} has neither a padding nor an EOS token "
                              f"to pad a batch with")
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval().requires_grad_(False)
    return RewardModel(spec, model, tokenizer)
