"""The server against a hostile or broken world, in process (the ASGI app, the official clients): session files that
cannot be written or were tampered with, and the artifact header digest."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from ninfer_bench.engine.runtime.engine import Engine  # noqa: E402
from ninfer_bench.engine.serve import sessions as sessions_mod  # noqa: E402
from ninfer_bench.engine.serve.app import create_app  # noqa: E402
from ninfer_bench.engine.serve.engine_thread import Backend  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    return Engine.load("tiny", device="cpu", max_context=512, max_concurrency=2)


class Served:
    def __init__(self, engine: Engine, session_dir=None, **backend):
        self.backend = Backend(engine, session_capacity=4, session_dir=str(session_dir) if session_dir else None,
                               **backend)
        self.restored, self.problems = self.backend.sessions.load()  # as serve() does before it listens
        self.http = TestClient(create_app(self.backend, 1 << 20))
        self.http.__enter__()  # the lifespan: starts the engine thread
        self.model = self.backend.model_id

    def close(self) -> None:
        self.http.__exit__(None, None, None)

    def complete(self, session: str | None = None, **body):
        return self.http.post("/v1/completions", json={"model": self.model, "prompt": [5, 6, 7, 8], "max_tokens": 6,
                                                       "temperature": 0, **({"session_id": session} if session else {}),
                                                       **body})


def test_a_session_that_cannot_be_written_never_fails_the_request(engine, tmp_path, monkeypatch, caplog):
    """A full or read-only --session-dir (torch.save raising RuntimeError, as it does there, after writing part of
    the temp file): the reply completes, says the session was not persisted, and no temp file stays; streamed, the
    finish chunk comes as usual. The session still continues from memory."""
    def full_disk(obj, path):
        open(path, "wb").write(b"\x00" * 10)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    s = Served(engine, tmp_path)
    try:
        monkeypatch.setattr(sessions_mod.torch, "save", full_disk)
        r = s.complete("full")
        assert r.status_code == 200, r.text
        assert r.json()["timings"]["session_persisted"] is False
        assert not list(tmp_path.rglob("*.tmp"))
        with s.http.stream("POST", "/v1/completions", json={"model": s.model, "prompt": [5, 6, 7, 8], "max_tokens": 6,
                                                            "temperature": 0, "stream": True,
                                                            "session_id": "full2"}) as resp:
            events = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")
                      and line.strip() != "data: [DONE]"]
        assert resp.status_code == 200 and "error" not in events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["timings"]["session_persisted"] is False
        assert not list(tmp_path.rglob("*.tmp"))
        assert "not saved" in caplog.text and "Traceback" not in caplog.text
        assert s.backend.sessions.get("full") is not None  # kept in memory all the same
        monkeypatch.undo()
        assert s.complete("ok").json()["timings"]["session_persisted"] is True
    finally:
        s.close()


def test_leftover_temp_files_are_swept_at_start(engine, tmp_path):
    s = Served(engine, tmp_path)
    try:
        assert s.complete("a").status_code == 200
        folder = s.backend.sessions.dir
    finally:
        s.close()
    (folder / "b.pt.tmp").write_bytes(b"half a session")
    s = Served(engine, tmp_path)
    try:
        assert not (folder / "b.pt.tmp").exists() and (folder / "a.pt").exists()
        assert s.backend.sessions.get("a") is not None
    finally:
        s.close()


def _saved(engine, tmp_path) -> tuple[object, dict]:
    """A session 'conv' saved by a server of ``engine``: (its file, the document in it)."""
    s = Served(engine, tmp_path)
    try:
        assert s.complete("conv").status_code == 200
        path = s.backend.sessions.dir / "conv.pt"
    finally:
        s.close()
    return path, torch.load(path, weights_only=True)


@pytest.mark.parametrize("how", ["flipped", "shape", "broadcastable"])
def test_a_damaged_session_file_is_dropped_and_said_so_once(engine, tmp_path, how):
    """Flipped bytes in a saved GDN state, a tensor of the wrong shape (the digest then recomputed, as a hand edit
    would), a broadcastable wrong shape: the server starts, drops the session with one line, answers the first
    request naming it with a 404 in the API's shape, and then takes the id as a new session."""
    path, doc = _saved(engine, tmp_path)
    ssm = next(iter(doc["state"]["cache"]["ssm"].values()))
    if how == "flipped":
        data = bytearray(path.read_bytes())
        raw = ssm.contiguous().view(torch.uint8).numpy().tobytes()[:64]
        at = bytes(data).find(raw)
        assert at > 0
        for i in (0, 7, 40):
            data[at + i] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        key = next(iter(doc["state"]["cache"]["ssm"]))
        doc["state"]["cache"]["ssm"][key] = ssm[:1] if how == "broadcastable" else torch.zeros(3, 5)
        doc["shapes"] = sessions_mod.state_shapes(doc["state"])
        doc["digest"] = sessions_mod.state_digest(doc)
        torch.save(doc, path)
    s = Served(engine, tmp_path)
    try:
        assert s.backend.sessions.get("conv") is None
        r = s.complete("conv")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
        assert "conv" in r.json()["error"]["message"]
        assert s.complete("conv").status_code == 200  # the id is free again
    finally:
        s.close()


# ---- who may talk to the server (engine/serve/guard.py) ---------------------------------------------------------
def guarded(engine, **policy):
    from ninfer_bench.engine.serve.guard import AccessPolicy

    backend = Backend(engine, session_capacity=0)
    http = TestClient(create_app(backend, 1 << 20, AccessPolicy(**policy)))
    http.__enter__()
    return backend, http


def test_an_api_key_guards_the_v1_routes_and_the_official_clients_send_it(engine):
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    backend, http = guarded(engine, api_key="s3cret")
    try:
        ok = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", max_retries=0, http_client=http)
        assert ok.completions.create(model=backend.model_id, prompt="hi", max_tokens=3, temperature=0).choices
        bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", max_retries=0, http_client=http)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.body["code"] == "invalid_api_key"
        a = anthropic.Anthropic(base_url="http://testserver", api_key="s3cret", max_retries=0, http_client=http)
        msg = a.messages.create(model=backend.model_id, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert msg.content is not None
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url="http://testserver", api_key="nope", max_retries=0, http_client=http) \
                .messages.create(model=backend.model_id, max_tokens=3, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        r = http.post("/v1/completions", json={"model": backend.model_id, "prompt": "hi"})  # no key at all
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200  # liveness stays open
    finally:
        http.__exit__(None, None, None)


def test_a_loopback_server_answers_loopback_host_names_only(engine):
    """DNS rebinding: a page served from evil.example whose name was made to resolve to 127.0.0.1 sends Host
    evil.example; a loopback server refuses it and answers localhost / 127.0.0.1 / [::1] (and --allowed-hosts)."""
    from ninfer_bench.engine.serve.guard import AccessPolicy

    policy = AccessPolicy.for_bind("127.0.0.1", None, hosts=("myhost.lan",))
    assert AccessPolicy.for_bind("0.0.0.0", "k").hosts is None  # beyond loopback: any name (a key guards it)
    backend = Backend(engine, session_capacity=0)
    with TestClient(create_app(backend, 1 << 20, policy)) as http:
        for host, status in [("evil.example", 403), ("evil.example:8080", 403), ("localhost:8080", 200),
                             ("127.0.0.1:9", 200), ("[::1]:8080", 200), ("myhost.lan", 200)]:
            r = http.get("/v1/models", headers={"host": host})
            assert r.status_code == status, (host, r.text)
        r = http.post("/v1/messages", headers={"host": "evil.example"}, json={})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"  # Anthropic's shape


def test_cross_origin_browser_requests_are_refused_unless_listed(engine):
    """A web page's cross-origin POST (text/plain needs no preflight) is refused; a listed origin gets the CORS
    headers and its preflight answered; clients without Origin are untouched."""
    backend, http = guarded(engine, origins=frozenset({"https://app.example"}))
    try:
        body = json.dumps({"model": backend.model_id, "prompt": "hi", "max_tokens": 2, "session_id": "victim"})
        r = http.post("/v1/completions", content=body, headers={"origin": "https://evil.example",
                                                                 "content-type": "text/plain"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        r = http.options("/v1/completions", headers={"origin": "https://app.example",
                                                     "access-control-request-method": "POST"})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = http.post("/v1/completions", json={"model": backend.model_id, "prompt": "hi", "max_tokens": 2},
                      headers={"origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = http.post("/v1/completions", json={"model": backend.model_id, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        http.__exit__(None, None, None)


def test_serving_beyond_loopback_needs_a_key_or_insecure():
    from ninfer_bench.engine.serve.app import ServerOptions

    with pytest.raises(ValueError, match="--api-key KEY"):
        ServerOptions(host="0.0.0.0", port=0)
    ServerOptions(host="0.0.0.0", port=0, api_key="k")
    ServerOptions(host="0.0.0.0", port=0, insecure=True)
    ServerOptions(host="127.0.0.1", port=0)


def test_a_nan_temperature_is_named_as_such(engine):
    s = Served(engine)
    try:
        r = s.http.post("/v1/completions", content=f'{{"model": "{s.model}", "prompt": [1, 2], "temperature": NaN}}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "temperature: Input should be a finite number"
    finally:
        s.close()


def test_a_declared_media_type_must_agree_with_the_bytes():
    import base64
    import io

    from PIL import Image

    from ninfer_bench.engine.media.decode import check_declared_type
    from ninfer_bench.engine.media.sources import declared_type

    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    png = buf.getvalue()
    uri = "data:image/jpeg;base64," + base64.b64encode(png).decode()
    assert declared_type(uri) == "image/jpeg"
    with pytest.raises(ValueError, match="declares image/jpeg, but its bytes are a PNG"):
        check_declared_type(declared_type(uri), png, "image")
    check_declared_type("image/png", png, "image")
    check_declared_type(None, png, "image")
    check_declared_type("image/*", png, "image")
    with pytest.raises(ValueError, match="numpy array"):
        check_declared_type("image/png", b"\x93NUMPY\x01\x00", "video")


def test_a_client_gone_while_sending_its_body_leaves_no_traceback(tmp_path):
    """A client that disconnects in the middle of its request body: the server logs no traceback and goes on."""
    import socket

    from serveproc import ServeProcess

    from ninfer_bench.engine.artifact.loader import default_model

    s = ServeProcess(default_model(), tmp_path / "server.log")
    try:
        host, port = s.url.split("//")[1].rsplit(":", 1)
        for _ in range(3):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100000\r\n\r\n{\"model\": \"x\", \"prompt\": \"")
        r = s.post("/v1/completions", {"model": s.model, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        s.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log, log
