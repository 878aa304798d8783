"""An OpenAI-compatible chat-completions endpoint on the policy, for agent programs (`cispo.envs.agent_env`).

The server (standard library ``http.server``, one thread per connection) listens on 127.0.0.1 only, at a port
the system picks, and answers only requests that carry its random bearer token (``Authorization: Bearer <key>``;
401 otherwise): no one else on the machine can drive or read the policy. It holds no model: each request is
handed to its **session** (one per episode) as a `Pending` call, which the episode's environment answers
once the policy has sampled the completion; the request's thread waits until then.

A request names its session by its URL (``/sessions/<id>/v1/chat/completions``: the ``base_url`` an agent is
given), by the ``X-Session-Id`` header, or by the body's ``user`` field (beside ``/v1/chat/completions``). A
request of a session that has ended (or never was) gets 410; a malformed one 400, with OpenAI's error body
``{"error": {"message", "type", "code"}}``. ``GET /v1/models`` lists the one model, ``policy``.
``/v1/completions`` takes a text ``prompt`` (one string; tokenized as it is, special tokens' spellings read as
those tokens), with ``max_tokens`` and ``stop``; ``echo``, ``suffix`` and ``best_of`` > 1 are refused.
``include_stop_str_in_output`` (vLLM's field, either path) keeps the stop string in the answer, and what the
token that completed it wrote past it (``</calc>.``: a token may run on past the string): the text as sampled,
so that a next prompt that appends to it extends the row token for token (without it, a token that ran on leaves
the answer's text short of the row's, and a prompt that re-sends the stop string is a rewritten history).

What a request may ask (`read_request`): ``messages`` (text content, or lists of ``{"type": "text"}`` parts),
``tools`` (function tools), ``tool_choice`` ``auto`` or ``none`` (``required`` and a named function are
refused: nothing constrains what the policy writes), ``max_tokens`` / ``max_completion_tokens`` and ``stop``
(applied to the segment), ``n`` = 1 only, no ``stream``. ``temperature``, ``top_p``, ``seed`` and the other
sampling fields are read but not applied: the run samples at its own settings (``rollout.temperature``,
``rollout.top_p``), so that every call's log-probs are the behaviour policy's the trainer corrects for.
"""

from __future__ import annotations

import hmac
import json
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["AgentServer", "Session", "Pending", "RequestError", "read_request", "error_body", "MODEL_NAME"]

MODEL_NAME = "policy"
"""The model name the endpoint answers as (a request may name any model)."""
MAX_BODY_BYTES = 32 << 20
"""The largest request body read (413 past it)."""


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP ``status`` and one line of ``message``."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def error_body(message: str, code: str = "invalid_request_error") -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": code, "code": code, "param": None}}


@dataclass
class ChatRequest:
    """One request, as read (`read_request`): the ``messages`` (contents as text), the ``tools`` (OpenAI's
    function-tool dicts, [] for none), whether calls are read from the reply (``tool_choice`` not ``none``),
    the most tokens (None: the response's budget) and the stop strings; a ``/v1/completions`` request has its
    text ``prompt`` instead of messages (None for a chat request); ``include_stop``: the answer keeps the stop
    string and what its last token wrote past it (vLLM's ``include_stop_str_in_output``)."""

    messages: list[dict]
    tools: list[dict]
    read_calls: bool = True
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    prompt: str | None = None
    include_stop: bool = False


def _text(content) -> str:
    """A message's content as text: a string, None (""), or a list of ``{"type": "text", "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(400, "a message's content must be text or a list of text parts (images and audio are "
                            "not supported)")


def _call(call, i: int) -> dict:
    """An assistant message's tool call in the form chat templates read: its arguments as an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(400, f"messages: tool_calls[{i}] has no function name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise RequestError(400, f"messages: tool_calls[{i}].function.arguments is not JSON") from None
    return {"type": "function", "id": str(call.get("id") or ""), "function": {"name": function["name"],
                                                                              "arguments": arguments}}


def normal_message(message, i: int = 0) -> dict:
    """A request's message as the chat template is given it: role, content as text, an assistant's tool calls
    with their arguments as objects, a tool message's ``tool_call_id`` and ``name``; other keys dropped."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(400, f"messages[{i}] is not a message with a role")
    role = message["role"]
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(400, f"messages[{i}]: unknown role {role!r}")
    out = {"role": "system" if role == "developer" else role, "content": _text(message.get("content"))}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [_call(c, j) for j, c in enumerate(message["tool_calls"])]
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
        if message.get("name"):
            out["name"] = str(message["name"])
    return out


def read_request(body: dict, completions: bool = False) -> ChatRequest:
    """The `ChatRequest` of a chat-completions body (``completions``: of a ``/v1/completions`` body, its
    ``prompt`` one string); `RequestError` (400) for what the endpoint refuses."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    if body.get("stream"):
        raise RequestError(400, "stream: streaming is not supported (set stream=false)")
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise RequestError(400, "n: only n=1 is supported (an episode is one trajectory)")
    if completions:
        prompt = body.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(400, "prompt: one non-empty string is required")
        if body.get("echo") or body.get("suffix"):
            raise RequestError(400, "echo and suffix are not supported")
        return ChatRequest([], [], False, *_limits(body), prompt=prompt, include_stop=_include_stop(body))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: a non-empty list is required")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or any(not isinstance(t, dict) or t.get("type", "function") != "function"
                                          or not isinstance(t.get("function"), dict) for t in tools):
        raise RequestError(400, "tools: a list of {'type': 'function', 'function': {...}} is expected")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise RequestError(400, f"tool_choice={choice!r} is not supported: only 'auto' and 'none' (nothing "
                                f"constrains what the policy writes)")
    return ChatRequest([normal_message(m, i) for i, m in enumerate(messages)], list(tools), choice != "none",
                       *_limits(body), include_stop=_include_stop(body))


def _include_stop(body: dict) -> bool:
    """A body's ``include_stop_str_in_output`` (vLLM's field; default false), checked."""
    include = body.get("include_stop_str_in_output", False)
    if not isinstance(include, bool):
        raise RequestError(400, f"include_stop_str_in_output must be true or false, got {include!r}")
    return include


def _limits(body: dict) -> tuple[int | None, tuple[str, ...]]:
    """A body's ``max_tokens`` (or ``max_completion_tokens``) and ``stop`` strings, checked."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop: a string or a list of non-empty strings is expected")
    return max_tokens, tuple(stop)


# ---------------------------------------------------------------------------------------
# Sessions
# ---------------------------------------------------------------------------------------


@dataclass
class Pending:
    """A request waiting for its answer: the `ChatRequest`, then the HTTP status and body the episode gives
    (`answer`), which wakes the request's thread."""

    request: ChatRequest
    status: int = 0
    body: dict = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def answer(self, status: int, body: dict) -> None:
        if not self.done.is_set():
            self.status, self.body = status, body
            self.done.set()


class Session:
    """One episode's channel: the agent's requests and its end arrive in ``events`` (``("request", Pending)``,
    ``("end", value)``, ``("error", message)``), in order; once `close` d, every request is refused (410)."""

    def __init__(self, session_id: str) -> None:
        self.id = session_id
        self.events: queue.Queue = queue.Queue()
        self.closed: str | None = None
        self._lock = threading.Lock()
        self._pending: Pending | None = None

    def submit(self, request: ChatRequest) -> Pending:
        """Queue ``request`` for the episode; `RequestError` 410 where the session has ended and 409 where a call
        of this session is still waiting (an episode is one conversation: one call at a time)."""
        with self._lock:
            if self.closed is not None:
                raise RequestError(410, f"session {self.id}: the episode has ended ({self.closed})", "session_ended")
            if self._pending is not None and not self._pending.done.is_set():
                raise RequestError(409, f"session {self.id}: a call is already waiting for its answer (one call at "
                                        f"a time per episode)", "conflict")
            self._pending = Pending(request)
            self.events.put(("request", self._pending))
            return self._pending

    def close(self, reason: str) -> None:
        """End the session: a waiting call is answered 410 with ``reason``; later ones are refused."""
        with self._lock:
            if self.closed is None:
                self.closed = reason
            pending = self._pending
        if pending is not None:
            pending.answer(410, error_body(f"session {self.id}: the episode has ended ({reason})", "session_ended"))


# ---------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------


class AgentServer:
    """The endpoint (module docstring): ``base_url(session)`` for an episode, `open_session` / `drop_session`,
    `close`. Started at construction, in a daemon thread."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.api_key = "cispo-" + secrets.token_urlsafe(24)
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, 0), _handler(self))
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="cispo-agent-endpoint", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The server's root, ``http://127.0.0.1:<port>``."""
        return f"http://{self.host}:{self.port}"

    def base_url(self, session: Session) -> str:
        """The OpenAI ``base_url`` of ``session``: its requests need no other session mark."""
        return f"{self.url}/sessions/{session.id}/v1"

    def open_session(self) -> Session:
        session = Session(secrets.token_hex(8))
        with self._lock:
            self._sessions[session.id] = session
        return session

    def drop_session(self, session: Session, reason: str) -> None:
        """Close ``session`` (`Session.close`) and forget it: its requests are refused (410) from now on."""
        session.close(reason)
        with self._lock:
            self._sessions.pop(session.id, None)

    def session(self, session_id: str | None) -> Session:
        with self._lock:
            found = self._sessions.get(session_id or "")
        if found is None:
            shown = "no session given (use the base_url handed to the episode, an X-Session-Id header or the " \
                    "'user' field)" if not session_id else f"session {session_id}: no such episode (it has ended?)"
            raise RequestError(410 if session_id else 400, shown, "session_ended" if session_id else "no_session")
        return found

    def authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def close(self) -> None:
        """Refuse every session's calls and stop serving."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            s.close("the run has ended")
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(server: AgentServer) -> type:
    """The request handler class bound to ``server``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "cispo-agent-endpoint"

        def log_message(self, *args) -> None:  # quiet: a run's output is its own
            return

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self) -> tuple[str | None, str]:
            """The session the path names (None: none) and the path under ``/v1``."""
            path = self.path.split("?", 1)[0].rstrip("/")
            if path.startswith("/sessions/"):
                _, _, rest = path.partition("/sessions/")
                sid, _, tail = rest.partition("/")
                return sid, "/" + tail
            return None, path

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if not server.authorized(self.headers.get("Authorization")):
                return self._send(401, error_body("missing or wrong bearer token", "invalid_api_key"))
            _, path = self._route()
            if path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                                    "owned_by": "cispo", "created": 0}]})
            self._send(404, error_body(f"no such path: {self.path}", "not_found"))

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY_BYTES:
                self.close_connection = True
                return self._send(413, error_body(f"the body's Content-Length is not 0 to {MAX_BODY_BYTES} bytes"))
            raw = self.rfile.read(length) if length > 0 else b""
            if not server.authorized(self.headers.get("Authorization")):
                return self._send(401, error_body("missing or wrong bearer token", "invalid_api_key"))
            sid, path = self._route()
            try:
                if path not in ("/v1/chat/completions", "/v1/completions"):
                    raise RequestError(404, f"no such path: {self.path} (/v1/chat/completions, /v1/completions)",
                                       "not_found")
                try:
                    body = json.loads(raw or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise RequestError(400, "the body is not JSON") from None
                request = read_request(body, completions=path == "/v1/completions")
                user = body.get("user") if isinstance(body.get("user"), str) else None
                pending = server.session(sid or self.headers.get("X-Session-Id") or user).submit(request)
            except RequestError as e:
                return self._send(e.status, error_body(e.message, e.code))
            pending.done.wait()
            self._send(pending.status, pending.body)

    return Handler


def completion_body(message: dict, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """A chat-completion response with one choice; a text completion's where ``message`` has no role (its
    ``{"text": ...}``)."""
    chat = "role" in message
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None,
              **({"message": message} if chat else message)}
    return {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": MODEL_NAME, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
