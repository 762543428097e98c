"""Serve a reward model over HTTP, for `reward.remote.urls` of any number of online-RL runs.

    python -m align_anything serve-reward outputs/rm/final --port 8000
    # in the runs: reward.remote.urls=[http://HOST:8000/score]

The model is output_dir/final of a task=rm run (a LoRA run's adapter folder too, applied to its
base model). The protocol is `align_anything.rewards.remote`'s: POST a JSON object
`{"prompts": [...], "completions": [...], ...}` (any path; other keys are ignored) and get
`{"rewards": [...]}`, one score per completion. A prompt is a list of `{"role", "content"}`
messages or a string (one user message); each (prompt, completion) is rendered through the
reward model's own chat template exactly as the online trainer's in-process reward model
renders it (`data.encode.reward_model_ids`) and scored where `task=rm` read its scores.
`GET /health` answers `{"status": "ok"}`.

Requests are served on threads and scored one at a time (one model), in batches of
`--batch-size` sequences. With `--token-env NAME`, requests must carry `Authorization: Bearer
<the value of $NAME>` (a run sends it with `reward.remote.headers_env=NAME`); the token is never
printed. The log has one line per request: its rows, status and time, never its headers.
"""

from __future__ import annotations

import argparse
import hmac
import json
import math
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from align_anything.errors import ConfigError, UserError, report
from align_anything.http_json import answer_json

# Largest request body accepted (bytes); a larger one is refused with 413.
MAX_BODY_BYTES = 256 * 1024 * 1024


class BadRequest(Exception):
    """The request cannot be scored: answered with 400 and this message."""


class RewardScorer:
    """A reward model and its tokenizer, scoring (prompt, completion) pairs in batches."""

    def __init__(
        self, model: Any, tokenizer: Any, *, batch_size: int, max_length: int, device: str
    ) -> None:
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size, self.max_length, self.device = batch_size, max_length, device
        self.pad_id = tokenizer.pad_token_id
        self._lock = threading.Lock()  # one forward at a time: the threads share the model

    def _ids(self, index: int, prompt: Any, completion: Any) -> list[int]:
        from align_anything.data.convert import RowRejected, as_messages
        from align_anything.families.language.encode import reward_model_ids

        if not isinstance(completion, str):
            raise BadRequest(f"completions[{index}] is a {type(completion).__name__}, not text")
        try:
            ids = reward_model_ids(
                self.tokenizer, as_messages(prompt, "prompts", "user"), completion
            )
        except RowRejected as reason:
            raise BadRequest(f"prompts[{index}]: {reason}") from None
        if len(ids) > self.max_length:
            raise BadRequest(
                f"row {index}: {len(ids)} tokens, more than this server's --max-length "
                f"{self.max_length}"
            )
        return ids

    def score(self, prompts: list[Any], completions: list[Any]) -> list[float | None]:
        """One score per row (None for a non-finite one); BadRequest for a row it cannot
        render."""
        import torch

        from align_anything.families.language import pad_rows
        from align_anything.families.language.forward import sequence_scores
        from align_anything.training.batching import to_device

        sequences = [
            self._ids(i, p, c) for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]
        scores: list[float | None] = []
        with self._lock, torch.no_grad():
            for start in range(0, len(sequences), self.batch_size):
                part = sequences[start : start + self.batch_size]
                batch = to_device(pad_rows(part, part, self.pad_id), self.device)
                for value in sequence_scores(self.model, batch).tolist():
                    scores.append(value if math.isfinite(value) else None)
        return scores


def parse_request(body: bytes) -> tuple[list[Any], list[Any]]:
    """(prompts, completions) of a request body, or BadRequest naming what is wrong."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not JSON ({err})") from None
    if not isinstance(request, dict):
        raise BadRequest("the body must be a JSON object with 'prompts' and 'completions'")
    prompts, completions = request.get("prompts"), request.get("completions")
    if not isinstance(prompts, list) or not isinstance(completions, list):
        raise BadRequest("'prompts' and 'completions' must both be lists")
    if len(prompts) != len(completions):
        raise BadRequest(f"{len(prompts)} prompts for {len(completions)} completions")
    return prompts, completions


def make_handler(scorer: RewardScorer, token: str | None) -> type[BaseHTTPRequestHandler]:
    """The request handler class of a server around `scorer` (`token`: required bearer token)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "align-anything-reward"

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            answer_json(self, status, payload)

        def _authorised(self) -> bool:
            if token is None:
                return True
            given = self.headers.get("Authorization", "")
            return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") == "/health":
                self._answer(200, {"status": "ok"})
            else:
                self._answer(404, {"error": "POST scoring requests; GET /health only"})

        def do_POST(self) -> None:  # noqa: N802
            start, rows, status = time.perf_counter(), 0, 500
            try:
                if not self._authorised():
                    status = 401
                    self.close_connection = True  # the body stays unread
                    self._answer(401, {"error": "missing or wrong bearer token"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    status = 413
                    self.close_connection = True
                    self._answer(413, {"error": f"body over {MAX_BODY_BYTES} bytes"})
                    return
                prompts, completions = parse_request(self.rfile.read(length))
                rows = len(completions)
                rewards = scorer.score(prompts, completions)
                status = 200
                self._answer(200, {"rewards": rewards})
            except BadRequest as err:
                status = 400
                self._answer(400, {"error": str(err)})
            except Exception as err:  # noqa: BLE001 - answer, log, keep serving
                self._answer(500, {"error": f"{type(err).__name__}: {err}"})
            finally:
                seconds = time.perf_counter() - start
                self.log_message("POST %s %d rows -> %d (%.3f s)", self.path, rows, status, seconds)

        def log_request(self, code: Any = "-", size: Any = "-") -> None:
            """Only do_POST's own line (with rows and time) and errors are logged."""

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            print(f"{self.address_string()} {format % args}", file=sys.stderr, flush=True)

    return Handler


def make_server(
    scorer: RewardScorer, *, host: str, port: int, token: str | None = None
) -> ThreadingHTTPServer:
    """A threaded HTTP server on (host, port) (port 0: a free one, `server.server_port`)."""
    server = ThreadingHTTPServer((host, port), make_handler(scorer, token))
    server.daemon_threads = True
    return server


def load_scorer(
    model_dir: str, *, batch_size: int, max_length: int, device: str = "auto"
) -> RewardScorer:
    """The reward model of `model_dir` (see `rewards.scoring.load_reward_model`) as a scorer, in
    fp32 on `device` (auto: the first GPU if there is one, else the CPU)."""
    import torch

    from align_anything.rewards.scoring import load_reward_model

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_reward_model(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return RewardScorer(
        model, tokenizer, batch_size=batch_size, max_length=max_length, device=device
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything serve-reward", description=__doc__.split("\n")[0]
    )
    parser.add_argument("model", help="a reward-model folder (output_dir/final of task=rm)")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0: every interface)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    parser.add_argument("--max-length", type=int, default=4096,
                        help="longest rendered sequence accepted (tokens)")  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, …")
    parser.add_argument("--token-env", metavar="NAME",
                        help="require 'Authorization: Bearer $NAME' on every request")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.batch_size < 1 or args.max_length < 1 or not 0 <= args.port < 65536:
            raise ConfigError("--batch-size and --max-length must be >= 1, --port in 0..65535")
        token = None
        if args.token_env is not None:
            token = os.environ.get(args.token_env, "").strip()
            if not token:
                raise ConfigError(f"--token-env {args.token_env}: the variable is not set")
        scorer = load_scorer(
            args.model, batch_size=args.batch_size, max_length=args.max_length, device=args.device
        )
        try:
            server = make_server(scorer, host=args.host, port=args.port, token=token)
        except OSError as err:
            raise UserError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None
    except UserError as err:
        return report(err)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    host, port = server.server_address[:2]
    print(
        f"serving reward model {args.model} on http://{host}:{port}/ (POST "
        '{"prompts": [...], "completions": [...]} -> {"rewards": [...]}; '
        f"{scorer.device}, batches of {scorer.batch_size}"
        + (", bearer token required" if token else "") + ")",
        flush=True,
    )  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("serve-reward: stopping", file=sys.stderr, flush=True)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
