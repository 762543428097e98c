"""Remote rewards: a reward server reached over HTTP, used like a reward function.

The protocol (`reward.remote.urls`; `python -m align_anything serve-reward` serves a `task=rm`
model this way):

    POST <url>   Content-Type: application/json
    {"prompts": [...], "completions": [...], "<field>": [...], ...}
    → 200 {"rewards": [float or null, ...]}

one entry per completion in every list, exactly the arguments a reward function gets (a prompt
is repeated for its G completions; the fields are the prompt data's other columns, and for an
image-text or audio-text policy the rows' own media, `prompt_images` / `prompt_audio`, see
below); a reward is
a finite number or null ("no opinion", as a function's None): NaN, Infinity, a string or a
boolean (`true` is an answer to another question, not a reward of 1) fail the request, naming
the URL and the row. Rows go in requests of at most `max_rows` each, one after the other.

The text-to-image tasks send images in place of completions, each as the base64 text of its PNG
file (RGB, the run's resolution; lossless, so the server sees exactly the generated pixels):

    POST <url>   Content-Type: application/json
    {"prompts": ["a red circle", ...], "images": ["iVBORw0KGgo...", ...], "<field>": [...], ...}
    → 200 {"rewards": [float or null, ...]}

(in Python: `PIL.Image.open(io.BytesIO(base64.b64decode(entry)))`).

Media of the prompts (an image-text or audio-text policy): `prompt_images` holds, per
completion, the list of its row's images, each the base64 text of a PNG file (RGB, the picture
as the data gave it, lossless); `prompt_audio` the list of its row's clips, each a list of
float samples (mono, at the model's sampling rate):

    {"prompts": [...], "completions": [...], "prompt_images": [["iVBORw0KGgo...", ...], ...], ...}

(in Python: `PIL.Image.open(io.BytesIO(base64.b64decode(entry)))`). The same encoding serves
any other PIL image or numpy array a field holds.

Several URLs: each URL is one reward of its own, with its own weight in `reward.weights` (after
the functions and the reward model), scored on every completion and added up with the others:
what OpenRLHF does with several `remote_rm_url`s (each one a reward model, every sample sent to
each). Spreading rows over replicas of one server is a load balancer's job, in front of one URL.

Failures: a connection error, a timeout (`timeout_s` is a deadline for the whole answer, from
connecting to its last byte: a server that trickles its answer a byte at a time is cut off
there, which urllib's own timeout, a bound on each wait for the next bytes, would not do),
HTTP 408, 429 or 5xx is retried `retries` times after backoff_s,
2·backoff_s, 4·backoff_s, … seconds; any other HTTP error (401, 400, …), an answer that is not
JSON or not `{"rewards": [...]}`, or the wrong number of rewards fails at once (a retry would
get the same). Either way one `RowsFailed` names the URL and what happened, and
`rewards.score_completions` turns it into a `RewardError` naming the data rows of that request.

Secrets: request headers (an auth token) come from an environment variable the config names
(`reward.remote.headers_env`), never from the config file; neither headers nor the variable's
value appear in any message, and URLs are shown without user info or query string.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from align_anything.errors import ConfigError
from align_anything.rewards.functions import RowsFailed

# HTTP statuses worth a retry: the request timed out, the server is overloaded or failed.
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Longest wait between two attempts.
MAX_BACKOFF_S = 60.0
# Characters of a server's error text quoted in a message.
_QUOTED_CHARS = 200


def shown_url(url: str) -> str:
    """`url` fit for a log: scheme, host, port and path, without user info (`user:pass@`) or
    query string (`?key=…`), which may hold credentials."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    query = "?…" if parts.query else ""
    return f"{parts.scheme}://{host}{port}{parts.path}{query}"


def headers_from_env(name: str | None, *, key: str = "reward.remote.headers_env") -> dict[str, str]:
    """The request headers held by environment variable `name` (None: no headers). The value is
    a JSON object of headers (`{"Authorization": "Bearer …", "X-Team": "rl"}`) or, otherwise,
    a token sent as `Authorization: Bearer <value>`. ConfigError (naming the variable, never
    its value) when it is unset or empty, or a JSON object with non-string values."""
    if name is None:
        return {}
    value = os.environ.get(name, "")
    if not value.strip():
        raise ConfigError(
            f"{key}={name!r}: the environment variable {name} is not set (or empty); export it "
            "with the reward server's token (or a JSON object of headers) before the run"
        )
    text = value.strip()
    if not text.startswith("{"):
        return {"Authorization": f"Bearer {text}"}
    try:
        headers = json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(
            f"{key}={name!r}: the environment variable {name} starts with '{{' but is not a JSON "
            "object of headers; give a token, or a JSON object such as "
            '{"Authorization": "Bearer <token>"}'
        ) from None
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise ConfigError(
            f"{key}={name!r}: the environment variable {name} must be a token or a JSON object "
            "of header names to string values"
        )
    return headers


def media_json(value: Any) -> Any:
    """JSON for what `json` cannot write itself among the rows' fields: a PIL image as the
    base64 text of its PNG file (RGB; lossless), a numpy array (audio samples) or number as
    a list or a plain number. Anything else stays unwritable (`TypeError`: the request fails
    naming its rows)."""
    if hasattr(value, "save") and hasattr(value, "mode") and hasattr(value, "size"):
        buffer = io.BytesIO()
        value.convert("RGB").save(buffer, format="PNG")
        return base64.b64encode(buffer.getvalue()).decode("ascii")
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _Attempt(Exception):
    """One failed attempt: `retry` says whether another attempt may succeed; `row`, the
    answer's position at fault, when one is (its row alone is named)."""

    def __init__(self, message: str, *, retry: bool, row: int | None = None) -> None:
        super().__init__(message)
        self.retry, self.row = retry, row


class _Deadline:
    """A deadline for one request: when it passes, every socket the request opened is shut
    down, which ends a read blocked on it at once (a timer thread does it; `cancel` stops
    the timer once the answer is complete)."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _watched(base: type, deadline: _Deadline) -> type:
    """An `http.client` connection class whose sockets `deadline` watches."""

    class Watched(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            super().connect()
            deadline.watch(self.sock)

    return Watched


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    """urllib's opener (proxies from the environment, redirects, HTTPS) whose connections
    `deadline` watches."""

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(_watched(http.client.HTTPConnection, deadline), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req: Any) -> Any:
            return self.do_open(
                _watched(http.client.HTTPSConnection, deadline), req, context=self._context
            )

    return urllib.request.build_opener(HTTP, HTTPS)


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[_Deadline]:
    deadline = _Deadline(seconds)
    try:
        yield deadline
    finally:
        deadline.cancel()


class RemoteReward:
    """A reward server as a reward function: `reward(prompts=..., completions=..., **fields)`
    returns one float or None per completion, or raises `rewards.RowsFailed`."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        max_rows: int,
        headers: Mapping[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"reward.remote.urls: {shown_url(url)!r} is not an http(s) URL")
        if parts.username is not None or parts.password is not None:
            raise ConfigError(
                f"reward.remote.urls: {shown_url(url)!r} carries credentials (user:password@), "
                "which the saved config would keep; put them in the environment variable that "
                "reward.remote.headers_env names"
            )
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_rows < 1:
            raise ValueError(
                f"timeout_s > 0, retries >= 0, backoff_s >= 0 and max_rows >= 1 expected, got "
                f"{timeout_s}, {retries}, {backoff_s}, {max_rows}"
            )
        self.url = url
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.max_rows = max_rows
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        self._sleep = sleep

    def __repr__(self) -> str:  # headers stay out of every representation
        return f"RemoteReward({shown_url(self.url)!r})"

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[str] | None = None,
        images: Sequence[Any] | None = None, **fields: Sequence[Any],
    ) -> list[float | None]:  # fmt: skip
        key, outputs = ("images", images) if images is not None else ("completions", completions)
        assert outputs is not None, "a reward gets completions= or images="
        rewards: list[float | None] = []
        for start in range(0, len(outputs), self.max_rows):
            rows = range(start, min(start + self.max_rows, len(outputs)))
            sent = [outputs[i] for i in rows]
            body = {
                "prompts": [prompts[i] for i in rows],
                key: sent,  # images become base64 PNG text in the request (media_json)
                **{name: [values[i] for i in rows] for name, values in fields.items()},
            }
            rewards += self._request(body, rows)
        return rewards

    def _request(self, body: dict[str, list], rows: range) -> list[float | None]:
        """One chunk of rows, with retries; its rewards or RowsFailed."""
        where = f"POST {shown_url(self.url)}"
        try:
            data = json.dumps(body, default=media_json).encode()
        except (TypeError, ValueError) as err:
            raise RowsFailed(f"{where}: the rows cannot be sent as JSON ({err})", rows) from None
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                return self._parse(self._post(data), len(rows))
            except _Attempt as failed:
                if not failed.retry:
                    at_fault = rows if failed.row is None else [rows[failed.row]]
                    raise RowsFailed(f"{where}: {failed}", at_fault) from None
                if attempt + 1 == attempts:
                    tries = f"{attempts} attempts" if attempts > 1 else "1 attempt (no retries)"
                    raise RowsFailed(
                        f"{where}: {failed} (gave up after {tries}; the timeout is "
                        f"{self.timeout_s:g} s)",
                        rows,
                    ) from None
                self._sleep(min(self.backoff_s * 2**attempt, MAX_BACKOFF_S))
        raise AssertionError("unreachable")

    def _post(self, data: bytes) -> bytes:
        """The answer's body, complete within `timeout_s` of the start, or `_Attempt`."""
        request = urllib.request.Request(self.url, data=data, headers=self._headers, method="POST")
        late = _Attempt(f"no answer within {self.timeout_s:g} s", retry=True)
        with _deadline(self.timeout_s) as deadline:
            try:
                with _opener(deadline).open(request, timeout=self.timeout_s) as response:
                    body = response.read()
            except Exception as err:  # noqa: BLE001 - what a cut connection raises varies
                raise (late if deadline.expired else self._failed(err, late)) from None
        if deadline.expired:  # an answer without a length, cut short at the deadline
            raise late
        return body

    @staticmethod
    def _failed(err: Exception, late: _Attempt) -> _Attempt:
        """The `_Attempt` of one request's exception (before the deadline passed)."""
        if isinstance(err, urllib.error.HTTPError):
            detail = _server_says(err)
            return _Attempt(
                f"HTTP {err.code} {err.reason}{detail}", retry=err.code in RETRIED_STATUSES
            )
        if isinstance(err, urllib.error.URLError):
            if isinstance(err.reason, TimeoutError):
                return late
            return _Attempt(f"cannot connect ({err.reason})", retry=True)
        if isinstance(err, TimeoutError):
            return late
        if isinstance(err, (OSError, http.client.HTTPException)):  # reset, cut short, …
            return _Attempt(f"connection failed ({type(err).__name__}: {err})", retry=True)
        raise err

    @staticmethod
    def _parse(raw: bytes, count: int) -> list[float | None]:
        expected = 'answer {"rewards": [float or null, ...]} with one per completion sent'
        try:
            answer = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            quoted = raw[:_QUOTED_CHARS].decode("utf-8", "replace")
            raise _Attempt(
                f"the answer is not JSON ({quoted!r}); {expected}", retry=False
            ) from None
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            keys = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
            raise _Attempt(f"the answer has no list 'rewards' (found {keys}); {expected}",
                           retry=False)  # fmt: skip
        if len(rewards) != count:
            raise _Attempt(
                f"answered {len(rewards)} rewards for the {count} completions sent; {expected}",
                retry=False,
            )
        for index, value in enumerate(rewards):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                kind = "a boolean" if isinstance(value, bool) else f"a {type(value).__name__}"
                raise _Attempt(
                    f"reward {index + 1} of the answer is {json.dumps(value)} ({kind}, not a "
                    f"number); {expected}",
                    retry=False, row=index,
                )  # fmt: skip
            if not math.isfinite(value):
                raise _Attempt(
                    f"reward {index + 1} of the answer is {json.dumps(value)}, not a finite "
                    f"number (null is no opinion); {expected}",
                    retry=False, row=index,
                )  # fmt: skip
        return [None if v is None else float(v) for v in rewards]


def _server_says(err: urllib.error.HTTPError) -> str:
    """': <the server's error message>' from an error answer's body, shortened; '' if none."""
    try:
        body = err.read()[:4096].decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the body is optional detail
        return ""
    try:
        parsed = json.loads(body)
        body = str(parsed.get("error", body)) if isinstance(parsed, dict) else body
    except json.JSONDecodeError:
        pass
    body = " ".join(body.split())[:_QUOTED_CHARS]
    return f": {body}" if body else ""


def remote_reward_functions(
    urls: Sequence[str],
    *,
    timeout_s: float,
    retries: int,
    backoff_s: float,
    max_rows: int,
    headers_env: str | None,
) -> list[tuple[str, RemoteReward]]:
    """(name, reward) per URL of `reward.remote`, for `rewards.score_completions` beside the
    reward functions. Names: `remote` for one URL, `remote_0`, `remote_1`, … for several (the
    metric keys `rewards/<name>/mean`; messages show the URL itself). Call it in the run's first
    set-up step: an unset `headers_env` variable is a ConfigError before any weights load."""
    headers = headers_from_env(headers_env)
    names = ["remote"] if len(urls) == 1 else [f"remote_{i}" for i in range(len(urls))]
    return [
        (name, RemoteReward(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                            max_rows=max_rows, headers=headers))
        for name, url in zip(names, urls, strict=True)
    ]  # fmt: skip
