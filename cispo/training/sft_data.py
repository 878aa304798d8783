"""The conversations of ``cispo sft`` and the tokens its loss counts.

Two sources (`load_examples`):

* **a chat file** (``data.path``): each row's ``messages`` in TRL's conversational format (``system`` /
  ``developer`` / ``user`` / ``assistant`` / ``tool`` turns; an assistant turn may carry OpenAI-style
  ``tool_calls`` and no content) and optionally ``tools`` (JSON schemas, passed to the chat template). Rows are
  read by `cispo.data.datasets.read_rows` and checked one by one (`check_chat`): a bad row is one `DataError`
  line naming the file, the line (or row) and the field (``messages[2].role``);
* **a built-in task's worked answers** (``data.task``: ``wordmath_calc.demonstrations``,
  ``guess_number.demonstrations``): the prompt's
  messages and the assistant's one turn as ``parts``, ``(text, trained)`` pieces, the environment's inline
  observation (``<result>49</result>``) untrained.

Each becomes an `Example`: ``ids`` and ``labels`` (``labels[i] = ids[i]`` where the token is trained,
`IGNORE` elsewhere). Which tokens are the assistant's:

1. **The chat template says** where it marks the assistant's text with ``{% generation %}`` … ``{%
   endgeneration %}``: transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives
   the mask (`template_marks_assistant`).
2. **Otherwise, prefix by prefix** (most templates, ChatML's among them): the tokens by which rendering
   ``messages[:k+1]`` extends ``messages[:k]`` rendered with the assistant turn opened
   (``add_generation_prompt=True``) are assistant message k's, up to and including the turn's end token
   (`cispo.models.loading.turn_end_id`, ``<|im_end|>``); what the template writes after it (ChatML's newline)
   is context, as the sampler never samples it. The turn's opening (``<|im_start|>assistant\\n``) is
   context too, as in RL, where it ends the prompt. A template whose rendering of ``messages[:k+1]`` does not
   begin with that prefix (one that rewrites earlier turns) is refused, naming the row, rather than guessed.
3. **Parts**: the prompt rendered with the turn opened, each piece's ids (``add_special_tokens=False``), then
   the turn's end: the encoding of the study's ``warm_start.py``, token for token.

Tool, user and system turns are context everywhere. An assistant turn's ``tool_calls`` that the template does
not render (SmolLM2's ChatML template has no tool format) is refused, naming the row: training on the turn
without its call would teach silence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from cispo.data.datasets import DataError, read_rows
from cispo.foundations.text import invalid_at

IGNORE = -100
"""The label of a token that is context (``torch.nn.functional.cross_entropy``'s ``ignore_index``)."""
ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a chat file's messages may have."""
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Example:
    """One conversation's token ids and labels (`IGNORE` where not trained)."""

    ids: list[int]
    labels: list[int]

    @property
    def trained(self) -> int:
        """How many of its tokens the loss counts."""
        return sum(label != IGNORE for label in self.labels)


class _Bad(Exception):
    """A row's problem: ``field`` (or None: the row) and why."""

    def __init__(self, field: str | None, reason: str) -> None:
        self.field, self.reason = field, reason


# --------------------------------------------------------------------------- reading and checking rows


def _text(value, field: str) -> str:
    """``value`` if it is a string of valid Unicode, else `_Bad` naming ``field``."""
    if not isinstance(value, str):
        raise _Bad(field, f"expected a string, got {'null' if value is None else type(value).__name__}")
    at = invalid_at(value)
    if at is not None:
        raise _Bad(field, f"not valid Unicode: a lone surrogate U+{ord(value[at]):04X} at character {at}")
    return value


def _check_tool_calls(calls, field: str) -> None:
    """`_Bad` unless ``calls`` is a list of OpenAI-style calls, each ``{"function": {"name": str, ...}}``."""
    if not isinstance(calls, list) or not calls:
        raise _Bad(field, "expected a non-empty list of calls [{'type': 'function', 'function': {'name': ..., "
                          "'arguments': ...}}]")
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _Bad(f"{field}[{i}]", "expected {'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
        _text(function.get("name"), f"{field}[{i}].function.name")


def _check_message(m, j: int) -> None:
    """`_Bad` naming ``messages[j]``'s field unless ``m`` is a message of a known role with a text content (an
    assistant's may be empty or null beside its ``tool_calls``)."""
    at = f"messages[{j}]"
    if not isinstance(m, dict):
        raise _Bad(at, f"expected a message {{'role': ..., 'content': ...}}, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        got = "no role" if "role" not in m else repr(role)
        raise _Bad(f"{at}.role", f"expected one of {', '.join(ROLES)}, got {got}")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise _Bad(f"{at}.tool_calls", f"only an assistant turn calls tools, this one is {role!r}")
        _check_tool_calls(calls, f"{at}.tool_calls")
    if m.get("content") is None and calls is not None:
        return
    if isinstance(m.get("content"), list):
        raise _Bad(f"{at}.content", "a list of content parts is not read: give the text as a string")
    _text(m.get("content"), f"{at}.content")


def check_chat(row) -> dict:
    """``{"messages", "tools"}`` of a chat file's row, checked (module docstring); `_Bad` otherwise."""
    if not isinstance(row, dict):
        raise _Bad(None, f"expected an object with messages, got {type(row).__name__}")
    if "messages" not in row:
        raise _Bad("messages", f"missing (the row has {', '.join(map(str, list(row)[:10])) or 'no fields'}); a "
                               "chat row holds messages: [{'role': 'user', 'content': ...}, {'role': 'assistant', "
                               "...}]")
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise _Bad("messages", "expected a non-empty list of messages")
    for j, m in enumerate(messages):
        _check_message(m, j)
    if not any(m["role"] == "assistant" for m in messages):
        raise _Bad("messages", "no assistant turn: nothing to train on")
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _Bad("tools", "expected a list of JSON schemas (objects), or null")
    return {"messages": [dict(m) for m in messages], "tools": tools or None}


def read_chats(path: str, split: str | None = None) -> list[tuple[str, str, dict]]:
    """``(file, location, chat)`` of every row of the chat file ``path``, checked (`check_chat`); the first bad
    row is a `DataError` naming the file, its line or row, and the field."""
    out = []
    for where, loc, row in read_rows(path, split):
        try:
            out.append((where, loc, check_chat(row)))
        except _Bad as e:
            raise DataError(where, e.reason, location=loc, field=e.field) from None
    if not out:
        raise DataError(path, "no rows (the file is empty)")
    return out


# --------------------------------------------------------------------------- which tokens are trained


def template_marks_assistant(tokenizer) -> bool:
    """Whether the chat template marks the assistant's text (``{% generation %}``), so that transformers
    gives the assistant mask itself."""
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def _render(tokenizer, messages: list[dict], tools, opened: bool = False) -> list[int]:
    """``messages`` through the chat template, as ids (``opened``: the assistant turn opened after them)."""
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=opened, tokenize=True, **extra)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _marked_by_template(tokenizer, chat: dict) -> Example:
    """The template's own assistant mask (``{% generation %}``)."""
    extra = {"tools": chat["tools"]} if chat["tools"] else {}
    out = tokenizer.apply_chat_template(chat["messages"], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, **extra)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    return Example(ids, [i if m else IGNORE for i, m in zip(ids, mask)])


def _by_prefixes(tokenizer, chat: dict, turn_end: int | None) -> Example:
    """Each assistant message's tokens: what rendering it adds to the conversation before it with the turn
    opened, up to and including the turn's end ``turn_end`` (module docstring, 2)."""
    messages, tools = chat["messages"], chat["tools"]
    ids = _render(tokenizer, messages, tools)
    labels = [IGNORE] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = _render(tokenizer, messages[:k], tools, opened=True), _render(tokenizer, messages[:k + 1],
                                                                                        tools)
        if through[:len(before)] != before or ids[:len(through)] != through:
            raise _Bad(f"messages[{k}]", "the chat template renders the conversation before this assistant turn "
                                         "differently once the turn follows (it rewrites earlier turns), so which "
                                         "tokens are the assistant's is unknown; use a template with "
                                         "{% generation %} marks")
        own = through[len(before):]
        if turn_end is not None and turn_end in own:
            own = own[:len(own) - own[::-1].index(turn_end)]  # through the turn's end; what follows is context
        labels[len(before):len(before) + len(own)] = own
        _check_calls_rendered(tokenizer, m, tokenizer.decode(own), k)
    return Example(ids, labels)


def _check_calls_rendered(tokenizer, message: dict, text: str, k: int) -> None:
    """`_Bad` when assistant message ``k`` calls a tool that its rendered ``text`` does not name: a template
    without a tool format, which would train the turn without its call."""
    for call in message.get("tool_calls") or []:
        if call["function"]["name"] not in text:
            raise _Bad(f"messages[{k}].tool_calls", f"the chat template does not render the call to "
                                                    f"{call['function']['name']!r} (it has no tool-call format): use "
                                                    "a model whose template renders tool calls, or write the call "
                                                    "into the content")


def encode_chat(tokenizer, chat: dict, turn_end: int | None) -> Example:
    """A checked chat's `Example`: the template's own mask where it marks the assistant's text, else prefix by
    prefix (module docstring). `_Bad` where the template cannot render it or nothing is trained."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    for k, m in enumerate(chat["messages"]):
        if m.get("tool_calls") and "tool_calls" not in template:
            _check_calls_rendered(tokenizer, m, "", k)  # a template that never reads them: said before it fails
    try:
        if template_marks_assistant(tokenizer):
            example = _marked_by_template(tokenizer, chat)
            for k, m in enumerate(chat["messages"]):
                if m["role"] == "assistant":
                    _check_calls_rendered(tokenizer, m, tokenizer.decode(example.ids), k)
        else:
            example = _by_prefixes(tokenizer, chat, turn_end)
    except _Bad:
        raise
    except Exception as e:  # noqa: BLE001 - a template is code: whatever it raises, this row does not render
        raise _Bad("messages", f"the chat template cannot render it ({type(e).__name__}: {str(e)[:200]})") from None
    if not example.trained:
        raise _Bad("messages", "no assistant token to train on (its turns render empty)")
    return example


def encode_parts(tokenizer, demo: dict, turn_end: int | None) -> Example:
    """A worked answer's `Example`: the chat-templated prompt with the turn opened, each piece's ids
    (trained or context), then the turn's end (the EOS without one), trained."""
    ids = _render(tokenizer, demo["messages"], None, opened=True)
    labels = [IGNORE] * len(ids)
    for text, trained in demo["parts"]:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    end = tokenizer.eos_token_id if turn_end is None else turn_end
    return Example(ids + [end], labels + [end])


# --------------------------------------------------------------------------- the run's examples


def task_demonstrations(data) -> list[dict]:
    """The built-in task's worked answers that ``data`` (`cispo.config.sft.SFTDataConfig`) asks for."""
    from cispo.data.tasks import guess_number, wordmath_calc

    if data.task == guess_number.NAME:
        return guess_number.demonstrations(data.seed, data.num_demonstrations)

    if data.calculator and data.call_share is not None:
        return wordmath_calc.mixed_demonstrations(data.seed, data.num_demonstrations, data.numbers, data.call_share)
    return wordmath_calc.demonstrations(data.seed, data.num_demonstrations, data.numbers, data.calculator)


def load_examples(data, tokenizer, max_length: int | None = None) -> list[Example]:
    """The run's examples: the chat file's rows (`read_chats`, `encode_chat`) or the task's worked answers
    (`encode_parts`). A row the tokenizer's template cannot serve, or longer than ``max_length``, is a
    `DataError` naming it (a task's answer: ``data.task``, its index)."""
    from cispo.models.loading import turn_end_id

    turn_end = turn_end_id(tokenizer)
    if data.path is None:
        rows = [(f"data.task={data.task}", f"demonstration {i}", d) for i, d in enumerate(task_demonstrations(data))]
        encode = encode_parts
    else:
        rows, encode = read_chats(data.path, data.split), encode_chat
    out = []
    for where, loc, row in rows:
        try:
            example = encode(tokenizer, row, turn_end)
        except _Bad as e:
            raise DataError(where, e.reason, location=loc, field=e.field) from None
        if max_length is not None and len(example.ids) > max_length:
            raise DataError(where, f"{len(example.ids)} tokens, more than max_length={max_length}", location=loc)
        out.append(example)
    return out


def batch_tensors(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``labels`` [B, T_max] of ``examples``."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, :len(e.ids)] = torch.tensor(e.ids)
        labels[i, :len(e.labels)] = torch.tensor(e.labels)
        mask[i, :len(e.ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
