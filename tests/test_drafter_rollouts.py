"""bundled/rollouts.py and the drafters' anchor range: blocks start in the generated part of a rollout row."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bundled import drafters, rollouts  # noqa: E402


def test_anchors_start_at_the_first_anchor_and_keep_labels_in_range():
    gen = torch.Generator().manual_seed(0)
    length, s, first = 40, 8, 25
    room = drafters.anchor_room(length, s, first)
    assert room == length - s + 2 - first
    a = drafters.anchors(3, length, s, room, gen, "cpu", first)
    for row in a.tolist():
        assert sorted(row) == list(range(first, length - s + 2))  # every allowed anchor once, none outside
    with pytest.raises(ValueError, match="no anchor"):
        drafters.anchor_room(length, s, length)
    with pytest.raises(ValueError, match=">= 1"):
        drafters.anchor_room(length, s, 0)


def test_rollout_batches_draw_whole_rows_and_report_their_prefix():
    chunks = [(5, np.arange(4 * 9).reshape(4, 9)), (7, 100 + np.arange(6 * 11).reshape(6, 11))]
    b = rollouts.RolloutBatches(chunks, batch=2, seed=0)
    seen = {0: set(), 1: set()}
    for _ in range(40):
        x = b.next()
        i = 0 if x.shape[1] == 9 else 1
        assert b.first_anchor == chunks[i][0] and x.dtype == np.int64
        for row in x:  # each row is one of the chunk's rows, whole
            match = [j for j in range(chunks[i][1].shape[0]) if (chunks[i][1][j] == row).all()]
            assert len(match) == 1
            seen[i].add(match[0])
    assert seen[0] == set(range(4)) and seen[1] == set(range(6))
    assert b.epochs == pytest.approx(80 / 10)
    with pytest.raises(ValueError, match="fewer than a batch"):
        rollouts.RolloutBatches([(5, np.zeros((1, 9)))], batch=2, seed=0)
    with pytest.raises(ValueError, match="no rollout rows"):
        rollouts.RolloutBatches([], batch=2, seed=0)


class _Greedy:
    """A stand-in with transformers' generate surface: the next token is the last one plus one (mod 50)."""

    def eval(self):
        return self

    def generate(self, ids, max_new_tokens, min_new_tokens, do_sample, eos_token_id, pad_token_id):
        assert not do_sample and eos_token_id is None and min_new_tokens == max_new_tokens
        out = [ids]
        for _ in range(max_new_tokens):
            out.append((out[-1][:, -1:] + 1) % 50)
        return torch.cat(out, dim=1)


def test_generate_keeps_prefixes_from_the_stream_and_stops_at_max_batches():
    stream = np.arange(1000) % 50
    opts = rollouts.RolloutOptions(rows=3, new_tokens=6, prefix=(10, 20), budget_s=60, max_batches=2)
    rows = []
    got = rollouts.generate(_Greedy(), stream, opts, torch.device("cpu"), seed=1, log=rows.append)
    assert len(got["chunks"]) == 2 and got["facts"]["rows"] == 6 and got["facts"]["generated_tokens"] == 36
    for p, r in got["chunks"]:
        assert 10 <= p <= 20 and r.shape == (3, p + 6)
        for row in r:
            assert ((np.diff(row[:p]) % 50) == 1).all()  # a window of the stream
            assert ((np.diff(row[p - 1:]) % 50) == 1).all()  # the stand-in's continuation
    assert [x["phase"] for x in rows] == ["rollouts", "rollouts"]
    with pytest.raises(ValueError, match="bad rows"):
        rollouts.RolloutOptions(rows=0, new_tokens=6, prefix=(10, 20), budget_s=60)
