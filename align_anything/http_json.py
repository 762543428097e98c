"""What the project's small HTTP servers (`serve-reward`, `serve-rollout`) share: a JSON answer
with its length, on `http.server`'s keep-alive connection."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


def answer_json(handler: BaseHTTPRequestHandler, status: int, payload: dict[str, Any]) -> None:
    """Send `payload` as the JSON body of a `status` response."""
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
