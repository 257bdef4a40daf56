"""Replayed acceptance (engine/spec/replay.py) and the plain partner of a speculative decode run: the profiles, the
realised acceptance against them, the tokens against plain decoding's, and the decode grid's refusals."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from ninfer_bench.cli import main
from ninfer_bench.engine.runtime.options import EngineOptions
from ninfer_bench.engine.spec.replay import constant_p, profile
from ninfer_bench.suites.decode import DecodeOptions, decode_runs, run_matrix

BASE = dict(model="tiny", synthetic=True, device="cpu", max_new_tokens=160, repeats=1, warmup=0)


@pytest.mark.parametrize("spec, k, tokens", [("dflash2", 7, 5.16), ("mtp", 3, 3.37)])
def test_seed_profile_gives_the_release_tokens_per_round(spec, k, tokens):
    p = profile("seed", spec, k)
    assert len(p) == k and len(set(p)) == 1
    assert 1 + sum(p[0] ** i for i in range(1, k + 1)) == pytest.approx(tokens, abs=1e-9)
    assert profile("seed", spec, 2) == [p[0]] * 2  # other K: the kind's conditional rate


def test_profiles_from_a_number_and_a_file(tmp_path):
    assert profile("0.5", "mtp", 3) == [0.5] * 3
    f = tmp_path / "p.json"
    f.write_text(json.dumps([0.9, 0.8, 0.7, 0.1]))
    assert profile(str(f), "dflash2", 3) == [0.9, 0.8, 0.7]
    with pytest.raises(ValueError, match="4 probabilities for 5"):
        profile(str(f), "dflash2", 5)
    for bad in ("1.5", "-0.1", "often", str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match="replay-acceptance"):
            profile(bad, "mtp", 3)
    (tmp_path / "bad.json").write_text('{"p": 0.5}')
    with pytest.raises(ValueError, match="JSON list"):
        profile(str(tmp_path / "bad.json"), "mtp", 3)
    with pytest.raises(ValueError, match="--spec mtp"):
        EngineOptions(replay_acceptance="seed")
    assert constant_p(3, 1.0) == pytest.approx(0.0, abs=1e-12) and constant_p(3, 4.0) == pytest.approx(1.0)


@pytest.mark.parametrize("spec, p", [("mtp:3", 1.0), ("dflash2:7", 0.0), ("dflash2:7", 0.6)])
def test_replayed_runs_keep_plain_tokens_at_the_profiles_acceptance(spec, p):
    """Each replayed run decodes the plain run's tokens; with p = 1 every draft is accepted, with p = 0 none, and in
    between the realised acceptance per position follows p^(i+1) (given by the conditional rate) within 4 standard
    errors."""
    runs = decode_runs(BASE, specs=(spec,), replay=str(p))
    assert [r.baseline for r in runs] == [True, False] and runs[1].default_label().endswith("-replay")
    plain, rep = run_matrix(runs)
    s = rep["summary"]
    assert s["tokens_sha256"] == plain["summary"]["tokens_sha256"] and s["plain"]["tokens_equal"]
    k, rounds = s["drafted_tokens"] // s["rounds"], s["rounds"]
    assert rep["config"]["replay_acceptance"] == str(p) and rep["config"]["replay_profile"] == [p] * k
    for i, got in enumerate(s["accepted_per_position"]):
        want = p ** (i + 1)
        if p in (0.0, 1.0):  # exact, but the last round may be cut by the length limit
            assert abs(got - want) <= 1 / rounds + 1e-12, (i, got, want)
        else:
            assert abs(got - want) <= 4 * math.sqrt(want * (1 - want) / rounds) + 1 / rounds, (i, got, want)
    assert s["plain"]["speedup"] > 0 and s["plain"]["label"] == plain["label"]


def test_replay_needs_a_plain_partner_and_greedy_rows():
    with pytest.raises(ValueError, match="drop --no-baseline"):
        decode_runs(BASE, specs=("mtp:3",), replay="seed", baseline=False)
    from ninfer_bench.engine.runtime.engine import Engine

    eng = Engine.load("tiny", synthetic=True, device="cpu", spec="mtp", replay_acceptance="0.5")
    with pytest.raises(ValueError, match="plain run's tokens"):
        eng.generate([5, 6, 7], max_new_tokens=4)
    with pytest.raises(ValueError, match="greedy"):
        eng.generate([5, 6, 7], max_new_tokens=4, temperature=0.7, reference=[1, 2, 3, 4])


def test_cli_shows_the_speed_up_over_plain_and_writes_one_file(tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--synthetic", "--device", "cpu", "--spec", "mtp",
                                  "-n", "16", "--repeats", "1", "--warmup", "0", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "speed-up over plain" in r.output and "tokens = plain" in r.output
    doc = json.loads(out.read_text())
    assert doc["label"] == "v3-mtp-k3" and doc["summary"]["plain"]["tokens_equal"]
    assert list(tmp_path.iterdir()) == [out]  # the plain partner's document is not written beside it
    r = CliRunner().invoke(main, ["decode", "--model", "tiny", "--synthetic", "--device", "cpu", "--spec", "mtp",
                                  "-n", "16", "--repeats", "1", "--warmup", "0", "--no-baseline"])
    assert r.exit_code == 0 and "speed-up over plain" not in r.output, r.output
    assert isinstance(DecodeOptions.make(**BASE, spec="mtp").engine_options, EngineOptions)
