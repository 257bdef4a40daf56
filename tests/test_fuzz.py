"""Fuzzing, bounded and seeded so a CI run is repeatable: schemathesis over the server's published OpenAPI schema (a
real ``serve`` of the random ``tiny`` preset: every route, a fixed number of examples each), and hypothesis over
the artifact and session readers. Whatever a client or a file holds, the answer is a clean refusal: no 5xx, the
API's own error shape, no traceback in the server's log; a reader raises its own error type, nothing else."""

from __future__ import annotations

import zlib

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ninfer_bench.engine.artifact.format import ArtifactError  # noqa: E402
from ninfer_bench.engine.artifact.reader import Artifact  # noqa: E402
from ninfer_bench.engine.artifact.writer import write_artifact  # noqa: E402
from ninfer_bench.engine.serve.sessions import Session, SessionStore, read_session_file  # noqa: E402

EXAMPLES = 12  # a route; the whole run stays within about a minute on a CI core


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    pytest.importorskip("fastapi")
    from serveproc import ServeProcess

    s = ServeProcess("tiny", tmp_path_factory.mktemp("fuzz") / "server.log", "--session-capacity", "2",
                     max_context=96)
    yield s
    s.stop()


def test_schemathesis_finds_no_server_error_on_any_route(tiny_server):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{tiny_server.url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/v1/messages",
                                       "/v1/messages/count_tokens", "/v1/models", "/health", "/v1/sessions"}
    seen = []
    for op in ops:
        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            body = case.body
            if isinstance(body, dict) and isinstance(body.get("model"), str) and zlib.crc32(body["model"].encode()) % 4:
                body["model"] = tiny_server.model  # most cases past the model check, into validation and generation
            response = case.call(base_url=tiny_server.url, timeout=60)
            case.validate_response(response, checks=[not_a_server_error])
            assert response.status_code < 500, response.text
            if response.status_code >= 400:  # the API's own error shape
                body = response.json()
                if op.path.startswith("/v1/messages"):
                    assert body.get("type") == "error" and isinstance(body["error"].get("message"), str), body
                else:
                    assert isinstance(body.get("error", {}).get("message"), str), body
            seen.append(response.status_code)

        run()
    assert len(seen) >= len(ops)
    log = tiny_server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]


def _small_artifact(path) -> bytes:
    write_artifact(path, tensors={"w": ("q4_g64_fp16", torch.randn(4, 64)), "v": ("fp32", torch.randn(3))},
                   components={"text": {"config": {"hidden_size": 64}, "tensors": ["w", "v"]}}, model_id="fuzz")
    return path.read_bytes()


@settings(max_examples=150, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 6000)))
def test_the_artifact_reader_refuses_damage_with_its_own_error(tmp_path_factory, edits, cut):
    """Bytes flipped anywhere in the header, JSON or payload, or the file cut short: opening and verifying either
    work (the damage missed everything checked, or hit the payload, which verify finds) or raise ArtifactError."""
    base = tmp_path_factory.getbasetemp() / "fuzz_artifact"
    base.mkdir(exist_ok=True)
    data = bytearray(_small_artifact(base / "a.ninfer"))
    for at, value in edits:
        if at < len(data):
            data[at] = value
    if cut is not None:
        data = data[:cut]
    path = base / "damaged.ninfer"
    path.write_bytes(bytes(data))
    try:
        with Artifact.open(path) as art:
            art.verify()
            for name, oid in art.bindings.items():
                if art.objects[oid].kind == "weight":
                    art.tensor(name, torch.float32)
    except ArtifactError:
        pass


@settings(max_examples=80, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 4000)))
def test_the_session_reader_refuses_damage_with_one_line(tmp_path_factory, edits, cut):
    """A damaged session file: read_session_file raises ValueError (one line for the log), or it reads and the
    store's load either restores it intact or drops it - never an exception out of load."""
    base = tmp_path_factory.getbasetemp() / "fuzz_sessions"
    store = SessionStore(2, base, "m")
    ids, ssm = [1, 2, 3], torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    store.put(Session("s", {"ids": ids, "cache": {"length": 3, "ssm": {"0": ssm}}}, ids + [4], "t"))
    data = bytearray((store.dir / "s.pt").read_bytes())
    for at, value in edits:
        if at < len(data):
            data[at] = value
    if cut is not None:
        data = data[:cut]
    (store.dir / "s.pt").write_bytes(bytes(data))
    try:
        read_session_file(store.dir / "s.pt")
    except ValueError as e:
        assert "\n" not in str(e)
    again = SessionStore(2, base, "m")
    loaded, problems = again.load()
    assert loaded in (0, 1) and all("\n" not in p for p in problems)
    if loaded:  # only what passed its digest: the state as it was saved
        got = again.get("s")
        assert got.ids == ids + [4] and torch.equal(got.state["cache"]["ssm"]["0"], ssm)
