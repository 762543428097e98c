"""Serve a vLLM engine for the rollouts of online-RL runs (`rollout.backend=vllm`,
`rollout.vllm.mode=server`), in its own process and, typically, its own environment:

    make vllm                                    # .venv-vllm: vLLM and its pins
    .venv-vllm/bin/python -m align_anything serve-rollout smollm2-135m-instruct --port 8000
    # in the run (any environment): rollout.backend=vllm rollout.vllm.mode=server
    #                               rollout.vllm.server_url=http://127.0.0.1:8000

MODEL is a model folder, a built-in name or a hub name: the architecture the runs train (a
run checks it at start-up and stops with one error when it differs); its weights are the
engine's until a run sends its own, which it does before its first round and after every
optimizer step. The protocol is `generation.vllm.RolloutClient`'s (JSON and safetensors
over HTTP, nothing unpickled). One engine serves one run at a time: requests are served on
threads but reach the engine one after the other, and the weights are whichever run sent them
last. `GET /health` answers `{"status": "ok"}`.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): weight updates go into
its model in memory. The module keeps the `if __name__ == "__main__":` guard vLLM needs when
it spawns workers.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from align_anything.errors import ConfigError, UserError, report
from align_anything.http_json import answer_json

# Largest request body accepted: a weight chunk (64 MiB from the trainer) or a generation round.
MAX_BODY_BYTES = 1024 * 1024 * 1024


class BadRequest(Exception):
    """Answered with 400 and this message."""


class RolloutService:
    """The engine behind the HTTP handler: one call at a time; weight tensors gathered between
    /weights/begin and /weights/end, then loaded together (vLLM reloads a layer once all of
    its tensors are there)."""

    def __init__(self, engine: Any, model: str) -> None:
        self.engine = engine
        self.model = model
        self.lock = threading.Lock()
        self.pending: list[tuple[str, Any]] | None = None

    def info(self) -> dict[str, Any]:
        return {
            "model": self.model, "architecture": self.engine.arch, "vllm": self.engine.version,
            "platform": self.engine.platform,
        }  # fmt: skip

    def begin(self) -> dict[str, Any]:
        with self.lock:
            self.pending = []
        return {"status": "ok"}

    def add(self, body: bytes) -> dict[str, Any]:
        from safetensors.torch import load

        try:
            tensors = load(body)
        except Exception as err:  # noqa: BLE001 - any parse failure is the client's
            raise BadRequest(f"the body is not safetensors bytes ({err})") from None
        with self.lock:
            if self.pending is None:
                raise BadRequest("POST /weights/begin first")
            self.pending.extend(tensors.items())
        return {"received": len(tensors)}

    def end(self) -> dict[str, Any]:
        with self.lock:
            if self.pending is None:
                raise BadRequest("POST /weights/begin first")
            pending, self.pending = self.pending, None
            start = time.perf_counter()
            count = self.engine.load_weights(iter(pending))
        return {"tensors": count, "seconds": time.perf_counter() - start}

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        requests = request.get("requests")
        if not isinstance(requests, list) or not all(
            isinstance(r, list) and len(r) == 2 and isinstance(r[1], dict) for r in requests
        ):
            raise BadRequest("'requests' must be a list of [prompt token ids, sampling params]")
        start = time.perf_counter()
        with self.lock:
            outputs = self.engine.generate([(list(ids), params) for ids, params in requests])
        return {"outputs": outputs, "seconds": time.perf_counter() - start}

    def logprobs(self, request: dict[str, Any]) -> dict[str, Any]:
        sequences = request.get("sequences")
        if not isinstance(sequences, list) or not all(
            isinstance(s, list) and len(s) == 2 for s in sequences
        ):
            raise BadRequest("'sequences' must be a list of [prompt ids, completion ids]")
        with self.lock:
            return {"logprobs": self.engine.prompt_logprobs([(p, c) for p, c in sequences])}


def make_handler(service: RolloutService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "align-anything-rollout"

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            answer_json(self, status, payload)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.rstrip("/")
            if path == "/health":
                self._answer(200, {"status": "ok"})
            elif path == "/info":
                self._answer(200, service.info())
            else:
                self._answer(404, {"error": "GET /health or /info"})

        def do_POST(self) -> None:  # noqa: N802
            start, status = time.perf_counter(), 500
            path = self.path.rstrip("/")
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    status = 413
                    self.close_connection = True
                    self._answer(413, {"error": f"body over {MAX_BODY_BYTES} bytes"})
                    return
                body = self.rfile.read(length)
                if path == "/weights":
                    answer = service.add(body)
                elif path in ("/weights/begin", "/weights/end", "/generate", "/logprobs"):
                    try:
                        request = json.loads(body or b"{}")
                    except (json.JSONDecodeError, UnicodeDecodeError) as err:
                        raise BadRequest(f"the body is not JSON ({err})") from None
                    if not isinstance(request, dict):
                        raise BadRequest("the body must be a JSON object")
                    answer = {
                        "/weights/begin": lambda _: service.begin(),
                        "/weights/end": lambda _: service.end(),
                        "/generate": service.generate,
                        "/logprobs": service.logprobs,
                    }[path](request)
                else:
                    status = 404
                    self._answer(404, {"error": f"no such endpoint: POST {path}"})
                    return
                status = 200
                self._answer(200, answer)
            except BadRequest as err:
                status = 400
                self._answer(400, {"error": str(err)})
            except Exception as err:  # noqa: BLE001 - answer, log, keep serving
                self._answer(500, {"error": f"{type(err).__name__}: {err}"})
            finally:
                seconds = time.perf_counter() - start
                self.log_message("POST %s -> %d (%.3f s)", path, status, seconds)

        def log_request(self, code: Any = "-", size: Any = "-") -> None:
            """Only do_POST's own line (with its time) and errors are logged."""

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            print(f"{self.address_string()} {format % args}", file=sys.stderr, flush=True)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything serve-rollout", description=__doc__.split("\n")[0]
    )
    parser.add_argument("model", help="a model folder, built-in name or hub name")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0: every interface)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the engine's precision: the trainer's (fp32 on a CPU)")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="longest prompt + completion (tokens)")  # fmt: skip
    parser.add_argument("--kv-cache-gib", type=float, default=1.0,
                        help="KV-cache memory (GiB); 0: --gpu-memory-utilization decides")  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if not 0 <= args.port < 65536 or args.max_model_len < 1 or args.kv_cache_gib < 0:
            raise ConfigError("--port in 0..65535, --max-model-len >= 1, --kv-cache-gib >= 0")
        from align_anything.families.zoo import resolve_model_path
        from align_anything.generation.vllm_engine import EngineSettings, LocalEngine

        path = resolve_model_path(args.model, key="MODEL")
        engine = LocalEngine(
            EngineSettings(
                model=path,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                seed=args.seed,
                kv_cache_gib=args.kv_cache_gib or None,
                gpu_memory_utilization=args.gpu_memory_utilization,
            )  # fmt: skip
        )
        service = RolloutService(engine, args.model)
        try:
            server = ThreadingHTTPServer((args.host, args.port), make_handler(service))
        except OSError as err:
            raise UserError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None
        server.daemon_threads = True
    except UserError as err:
        return report(err)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    host, port = server.server_address[:2]
    print(
        f"serving rollouts of {args.model} on http://{host}:{port}/ ({engine.describe()}; "
        "rollout.vllm.server_url=" + f"http://{host}:{port})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("serve-rollout: stopping", file=sys.stderr, flush=True)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
