"""A real ``ninfer-bench serve`` subprocess for the HTTP tests (CPU, a free port, waits for its ready line)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    """``serve MODEL`` on a free port; ``url`` and ``model`` once it printed its ready line."""

    def __init__(self, model: str, log: Path, *args: str, max_context: int = 4096):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}
        cmd = [sys.executable, str(ROOT / "scripts" / "nb.py"), "serve", str(model), "--port", "0", "--device",
               "cpu", "--max-context", str(max_context), *args]
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 180
        while not (found := re.search(r"ready: (http://\S+)", log.read_text())):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                pytest.fail(f"server did not start:\n{log.read_text()}")
            time.sleep(0.1)
        self.url = found.group(1)
        self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def post(self, path: str, body, **kw) -> httpx.Response:
        """POST a JSON body (a dict), or raw bytes / text as given (for malformed-body tests)."""
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=data, headers={"content-type": "application/json"},
                          timeout=120, **kw)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health").json()
