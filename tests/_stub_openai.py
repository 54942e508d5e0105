"""A stub OpenAI-compatible server for the remote page's tests, run as its own process so a test can kill it:
``python tests/_stub_openai.py PORT RECORD_FILE``.

It records the body of every ``POST /v1/chat/completions`` as one JSON line in RECORD_FILE (flushed at once),
and answers by the last user message: one containing ``REFUSE`` gets HTTP 400 (an OpenAI error body), ``DROP``
gets two chunks and then a connection closed in the middle of the chunked body, ``SLOW`` gets a word every
0.1 s (200 words), anything else gets ``Hello from the stub`` in four chunks, a finish reason and usage.
``GET /v1/models`` lists ``stub-model``; ``GET /metrics`` serves a few of vLLM's gauges. Standard library only.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RECORD = ""
METRICS = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="stub-model"} 0.0\n'
           '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="stub-model"} 0.0\n')


def _chunk(payload: dict) -> bytes:
    data = f"data: {json.dumps(payload)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _delta(text: str | None = None, finish: str | None = None) -> dict:
    delta = {"content": text} if text is not None else {}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, status: int, body: dict | str, kind: str = "application/json") -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
        elif self.path == "/metrics":
            self._json(200, METRICS, "text/plain; version=0.0.4")
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        with open(RECORD, "a", encoding="utf-8") as f:
            f.write(json.dumps(body) + "\n")
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        last = next((m.get("content") or "" for m in reversed(body.get("messages") or []) if m.get("role") == "user"), "")
        if "REFUSE" in last:
            self._json(400, {"object": "error", "message": "This model's maximum context length is 8 tokens.",
                             "type": "BadRequestError", "code": 400})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        words = ["Hello", " from", " the", " stub"]
        if "SLOW" in last:
            words = [f" w{i}" for i in range(200)]
        for i, w in enumerate(words):
            self.wfile.write(_chunk(_delta(w)))
            self.wfile.flush()
            if "DROP" in last and i == 1:
                self.connection.shutdown(socket.SHUT_RDWR)  # in the middle of the body: no last chunk
                self.close_connection = True
                return
            if "SLOW" in last:
                time.sleep(0.1)
        self.wfile.write(_chunk(_delta(finish="stop")))
        self.wfile.write(_chunk({"choices": [], "usage": {"completion_tokens": len(words)}}))
        data = b"data: [DONE]\n\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
        self.wfile.flush()


if __name__ == "__main__":
    port, RECORD = int(sys.argv[1]), sys.argv[2]
    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
