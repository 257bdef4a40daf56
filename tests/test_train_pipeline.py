"""The bundled model's build pipeline (scripts/train_bundled.py --tiny) end to end on this CPU.

The pipeline runs once (module fixture): corpus of 200 stdlib files, tiny tokenizer and model, a few steps per
stage, fp32 artifact. Then: the artifact serves through the engine with speculative greedy == plain greedy;
the trained MTP head and drafters compute, through the engine's runners, exactly what the training modules
compute (so naming and semantics agree); joining the shipped parts reproduces the artifact and writes the card.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import train_bundled
from bundled import batches, corpus, drafters, export, target, tok
from ninfer_bench.engine.artifact.loader import BUNDLED_NAME
from ninfer_bench.engine.model.hybrid import DECODE, PREFILL
from ninfer_bench.engine.runtime.engine import Engine
from ninfer_bench.engine.sampling import SamplingParams
from ninfer_bench.engine.model.dflash import forward_train

RTOL = 1e-4  # fp32 engine vs fp32 training modules, relative RMS


def rel_rms(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundled")
    train_bundled.main(["--out", str(out), "--tiny", "--device", "cpu"])
    model, head, cfg = target.load_hf(out / "export" / "hf", torch.device("cpu"))
    tk = tok.load(out / "tokenizer")
    prompt = tk.encode(json.loads((out / "heldout_prompts.jsonl").read_text().splitlines()[0])["text"],
                       add_special_tokens=False).ids
    return {"out": out, "art": out / "export" / BUNDLED_NAME, "model": model.eval(), "mtp": head.eval(),
            "cfg": cfg, "tok": tk, "prompt": prompt[:70]}


def engine(built, **kw):
    return Engine.load(str(built["art"]), device="cpu", dtype="fp32", kv_dtype="fp32", max_context=512, **kw)


def test_pipeline_ships_what_the_card_needs(built):
    ship = built["out"] / "ship"
    files = sorted(p.name for p in ship.iterdir())
    assert len(files) <= export.MAX_SHIP_FILES and f"{BUNDLED_NAME}.part0" in files
    facts = json.loads((ship / "card_facts.json").read_text())
    rows = facts["eval"]["acceptance"]["rows"]
    assert {(r["spec"], r["k"]) for r in rows} >= {("mtp", 3), ("dflash2", 7), ("dflash", 15)}
    assert all(r["matches_greedy"] for r in rows), rows
    assert facts["eval"]["heldout"]["loss"] > 0 and facts["eval"]["quant"]["rel_rms"] < 1e-3
    assert set(facts["eval"]["needles"]["retrieval_by_length"]) == {"256", "512"}
    assert facts["target"]["steps"] == 6 and facts["drafters"]["steps"] == 4
    prompts = [json.loads(ln) for ln in (built["out"] / "heldout_prompts.jsonl").read_text().splitlines()]
    assert prompts and all({"id", "text", "source", "license"} <= set(p) for p in prompts)
    log = [json.loads(ln) for ln in (ship / "train_log.jsonl").read_text().splitlines()]
    assert {r["phase"] for r in log} == {"target", "drafters"}


@pytest.mark.parametrize("spec,k", [("mtp", 2), ("dflash", 3), ("dflash2", 3)])
def test_speculative_greedy_equals_plain_greedy(built, spec, k):
    want = engine(built).generate(built["prompt"], max_new_tokens=24, ignore_eos=True).tokens
    got = engine(built, spec=spec, draft_tokens=k).generate(built["prompt"], max_new_tokens=24, ignore_eos=True)
    assert got.tokens == want
    assert got.spec["rounds"] > 0


@torch.no_grad()
def test_mtp_head_in_artifact_matches_training_module(built):
    """Depth 0 at every prompt position, then the engine's recursive drafts 2 and 3 (depths 1 and 2)."""
    eng = engine(built, spec="mtp", draft_tokens=3)
    ids, extra = built["prompt"], [17, 23, 29]  # tokens after the prompt: t_n, t_n+1, t_n+2
    n = len(ids)
    seq = eng.acquire(ids, SamplingParams(max_new_tokens=4))
    _, hidden, _ = eng.prefill(seq.slot, ids)
    slots = eng.device_ids([seq.slot])
    h, logits = eng.drafter.forward(hidden[None], eng.device_ids([ids[1:] + extra[:1]]),
                                    torch.arange(n)[None], slots, n, PREFILL)
    engine_out = [logits[0]]
    for j in (1, 2):  # recursion: the head's own output one position back, the next token, position n + j - 1
        h, logits = eng.drafter.forward(h[:, -1:], eng.device_ids([[extra[j]]]), torch.tensor([[n + j - 1]]), slots,
                                        n + j, DECODE)
        engine_out.append(logits[0, 0])
    eng.release(seq)

    model, head = built["model"], built["mtp"]
    x = torch.tensor([ids + extra])
    hid, _ = target.run(model, x[:, : n + 2])
    cos, sin = target.rotary(model, hid)
    outs = head(hid, model.model.embed_tokens(x[:, 1:]), cos, sin, depths=3)
    assert rel_rms(engine_out[0], model.lm_head(outs[0][0, :n])) <= RTOL
    for d in (1, 2):
        assert rel_rms(engine_out[d], model.lm_head(outs[d][0, n + d - 1])) <= RTOL


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("k", [3, 15])
def test_block_drafter_in_artifact_matches_training_module(built, kind, k):
    eng = engine(built, spec=kind, draft_tokens=k)
    ids = built["prompt"]
    seq = eng.acquire(ids, SamplingParams(max_new_tokens=8))
    eng.start(seq)  # prefill, first token, drafter context
    runner, seen = eng.drafter, []
    head_logits = runner.head.logits
    runner.head.logits = lambda h: seen.append((h, head_logits(h))) or seen[-1][1]
    toks, _ = runner.draft([seq], k)
    eng.release(seq)

    model = built["model"]
    net = drafters.load(built["out"] / "drafters", built["cfg"])[kind].eval()
    assert len(ids) > net.c.window  # DFlash2's window really cuts the context
    _, taps = target.run(model, torch.tensor([ids]), net.c.target_layer_ids)
    anchor = seq.tokens[0]
    blk = torch.tensor([[anchor] + [net.c.mask_token_id] * k])
    with drafters.block_size(net, k + 1):
        h = forward_train(net, torch.cat(taps, -1), model.model.embed_tokens(blk), torch.tensor([[len(ids)]]))
    logits = model.lm_head(h[:, 1:]).float()
    # the drafted positions' rows (a CPU runner scores the whole block, the anchor row too: BlockDraftRunner.block)
    assert rel_rms(seen[0][1][:, -k:], logits) <= RTOL
    if net.selector is not None:
        want, _, _ = net.selector.walk(h[:, 1:], logits, torch.tensor([anchor]))
        assert toks.tolist() == want.tolist()
    else:
        assert toks[0].tolist() == logits[0].argmax(-1).tolist()


def test_join_rebuilds_the_artifact_and_writes_the_card(built, tmp_path):
    models, data = tmp_path / "models", tmp_path / "data"
    out = export.join(built["out"] / "ship", models, data)
    assert out.read_bytes() == built["art"].read_bytes()
    card = (models / "MODEL_CARD.md").read_text()
    for section in ("## Data", "## Training", "### Speculative decoding", "### Needle retrieval", "## Rebuild"):
        assert section in card
    assert "| mtp | 3 |" in card and "| dflash2 | 15 |" in card
    assert (models / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (data / "heldout_prompts.jsonl").is_file() and (models / "corpus_LICENSES.md").is_file()


def test_target_checkpoint_resumes_in_a_fresh_folder(tmp_path):
    """Two device calls: corpus..target ships a checkpoint; a fresh folder resumes it through export."""
    first, second = tmp_path / "first", tmp_path / "second"
    train_bundled.main(["--out", str(first), "--tiny", "--device", "cpu", "--stage", "corpus,tokenizer,target"])
    parts = sorted(p.name for p in (first / "ship").iterdir())
    assert parts and all(p.startswith("checkpoint.tar.part") for p in parts)
    train_bundled.main(["--out", str(second), "--tiny", "--device", "cpu", "--resume", str(first / "ship"),
                        "--stage", "corpus,tokenizer,drafters,export"])
    for name in ("tokenizer/tokenizer.json", "hf/model.safetensors"):
        assert (second / name).read_bytes() == (first / name).read_bytes()
    facts = json.loads((second / "ship" / "card_facts.json").read_text())
    assert facts["target"]["steps"] == 6 and all(r["matches_greedy"] for r in facts["eval"]["acceptance"]["rows"])


def test_retrieval_rows_end_with_the_answer_to_one_of_their_needles(built):
    tk = built["tok"]
    enc = lambda s: tk.encode(s, add_special_tokens=False).ids  # noqa: E731
    stream = np.load(built["out"] / "tokens" / "train.npy")
    b = batches.Batches(stream, 128, 2, 0, 1.0, enc, tok.newline_mask(tk, tk.get_vocab_size()))
    for _ in range(5):
        row = b.retrieval_row()
        assert row.shape == (129,)
        text = tk.decode(row.tolist(), skip_special_tokens=False)
        head, _, answer = text.rpartition('assert CONSTANTS["')
        key = answer.split('"]')[0]
        value = answer.rsplit("== ", 1)[1].strip()
        assert corpus.needle_text(key, int(value)) in head


def test_haystack_puts_the_needle_at_its_depth(built):
    tk = built["tok"]
    enc = lambda s: tk.encode(s, add_special_tokens=False).ids  # noqa: E731
    dec = lambda ids: tk.decode(ids, skip_special_tokens=False)  # noqa: E731
    filler = enc("def f(x):\n    return x + 1\n\n" * 40)
    text = corpus.build_haystack(filler, dec, 300, 0.5, "k1234567", 90210, enc)
    assert text.endswith(corpus.question_text("k1234567"))
    at = text.index(corpus.needle_text("k1234567", 90210))
    assert 0.3 < at / len(text) < 0.7
    assert abs(len(enc(text)) - 300) < 30


def test_retrained_drafters_replace_only_the_drafters(built, tmp_path):
    """scripts/retrain_drafters.py: a few steps from the artifact's own drafters; the new artifact keeps every other
    object's bytes, its drafters changed and still decode plain greedy's tokens; join installs it and the card."""
    import retrain_drafters

    from ninfer_bench.engine.artifact.reader import Artifact
    from ninfer_bench.engine.artifact.loader import text_identity

    out = tmp_path / "re"
    retrain_drafters.main(["--artifact", str(built["art"]), "--out", str(out), "--tiny", "--device", "cpu",
                           "--steps", "3"])
    new = out / "export" / BUNDLED_NAME
    with Artifact.open(built["art"]) as a, Artifact.open(new) as b:
        before, after = ({n: x.info(n).sha256 for n in x.bindings} for x in (a, b))
        assert b.artifact_id != a.artifact_id and set(before) == set(after)
        assert text_identity(b) == text_identity(a)  # the NIAH oracles stay the model's
    drafter = {n for n in before if n.startswith(("dflash.", "dflash2."))}
    assert drafter and all(before[n] == after[n] for n in set(before) - drafter)
    assert any(before[n] != after[n] for n in drafter)
    facts = json.loads((out / "ship" / "retrain_facts.json").read_text())
    assert facts["drafters"]["steps"] == 3 and facts["drafters"]["warm_start"]
    for label in ("before", "after"):
        rows = facts["acceptance"][label]["rows"]
        assert rows[0]["spec"] == "dflash2" and rows[0]["k"] == 7 and all(r["matches_greedy"] for r in rows)

    models = tmp_path / "models"
    export.join(built["out"] / "ship", models, tmp_path / "data")
    retrain_drafters.join(out / "ship", models)
    assert (models / BUNDLED_NAME).read_bytes() == new.read_bytes()
    cf = json.loads((models / "card_facts.json").read_text())
    assert cf["drafters"]["steps"] == 4 + 3 and [r["after_steps"] for r in cf["drafters"]["retrained"]] == [4]
    assert cf["export"]["sha256"] == facts["artifact"]["sha256"]
    log = [json.loads(ln) for ln in (models / "train_log.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in log if r["phase"] == "drafters") == 7
    assert "retrain" in (models / "MODEL_CARD.md").read_text()
    with pytest.raises(SystemExit, match="installed already"):
        retrain_drafters.join(out / "ship", models)
    got = engine({"art": models / BUNDLED_NAME}, spec="dflash2", draft_tokens=3)
    assert got.generate(built["prompt"], max_new_tokens=16, ignore_eos=True).tokens == \
        engine(built).generate(built["prompt"], max_new_tokens=16, ignore_eos=True).tokens

    # --fresh: new drafters, whose facts and log rows replace the build's instead of adding to them
    fresh = tmp_path / "fresh"
    retrain_drafters.main(["--artifact", str(models / BUNDLED_NAME), "--out", str(fresh), "--tiny", "--device", "cpu",
                           "--steps", "2", "--fresh", "--minutes-eval", "0.01"])
    retrain_drafters.join(fresh / "ship", models)
    cf = json.loads((models / "card_facts.json").read_text())
    assert cf["drafters"]["steps"] == 2 and [r["warm_start"] for r in cf["drafters"]["retrained"]] == [False]
    log = [json.loads(ln) for ln in (models / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["phase"] == "drafters"] == [2]


def test_retrained_on_the_greedy_path_changes_only_the_named_drafter(built, tmp_path):
    """--labels path --kinds dflash2 --blocks 4,8: only DFlash2's tensors change; the facts and the card say what
    trained on what; join keeps both drafters' parameter counts and agreement rows."""
    import retrain_drafters

    from ninfer_bench.engine.artifact.reader import Artifact

    out = tmp_path / "path"
    retrain_drafters.main(["--artifact", str(built["art"]), "--out", str(out), "--tiny", "--device", "cpu",
                           "--steps", "3", "--labels", "path", "--kinds", "dflash2", "--blocks", "4,8",
                           "--minutes-eval", "0.01"])
    new = out / "export" / BUNDLED_NAME
    with Artifact.open(built["art"]) as a, Artifact.open(new) as b:
        before, after = ({n: x.info(n).sha256 for n in x.bindings} for x in (a, b))
    changed = {n for n in before if before[n] != after[n]}
    assert changed and all(n.startswith("dflash2.") for n in changed)
    d = json.loads((out / "ship" / "retrain_facts.json").read_text())["drafters"]
    assert d["labels"] == "path" and d["kinds"] == ["dflash2"] and d["block_sizes"] == [4, 8]
    assert set(d["train_agreement"]) == {"dflash2_s4", "dflash2_s8"}

    models = tmp_path / "models"
    export.join(built["out"] / "ship", models, tmp_path / "data")
    retrain_drafters.join(out / "ship", models)
    cf = json.loads((models / "card_facts.json").read_text())
    assert set(cf["drafters"]["params"]) == {"dflash", "dflash2"}
    assert {k.split("_")[0] for k in cf["drafters"]["train_agreement"]} == {"dflash", "dflash2"}
    assert cf["drafters"]["retrained"][-1]["labels"] == "path" and cf["drafters"]["labels"] == "greedy"
    assert cf["drafters"]["retrained"][-1]["block_sizes"] == [4, 8]
    assert cf["drafters"]["block_sizes"] == list(drafters.BLOCK_SIZES)  # the build's, as the card says
    assert "greedy path" in (models / "MODEL_CARD.md").read_text()


def test_retrained_on_self_generated_rows(built, tmp_path):
    """--data self: the target's greedy continuations of training-code prefixes (prompts of one length a group, each
    ending at a line end); every generated token is the target's greedy one; the run trains on them, records them,
    and a second run with the same settings reads them back instead of generating."""
    import retrain_drafters

    from bundled import selfgen

    out = tmp_path / "self"
    argv = ["--artifact", str(built["art"]), "--out", str(out), "--tiny", "--device", "cpu", "--steps", "3",
            "--data", "self", "--gen-sequences", "5", "--gen-tokens", "12", "--gen-batch", "2",
            "--gen-prompt-tokens", "30,60", "--batch", "2", "--kinds", "dflash2", "--minutes-eval", "0.01"]
    retrain_drafters.main(argv)
    facts = json.loads((out / "ship" / "retrain_facts.json").read_text())
    assert facts["drafters"]["data"] == "self" and facts["drafters"]["steps"] == 3
    assert facts["selfgen"]["sequences"] == 5 and facts["selfgen"]["generated_tokens"] == 60
    assert facts["selfgen"]["epochs"] == 1.0  # 3 steps over the three parts (groups of 2, 2 and 1 rows)
    data = selfgen.load(out / "selfgen.npz")
    assert [len(g) for g in data["groups"]] and sum(len(g) for g in data["groups"]) == 5
    nl = tok.newline_mask(built["tok"], built["cfg"].vocab_size)
    eng = engine(built)
    for g, plen in zip(data["groups"], data["prompt_lengths"]):
        assert g.shape[1] == plen + 12 and 30 - 2 <= plen <= 60 and all(nl[g[:, plen - 1]])
        row = g[0].tolist()
        assert eng.generate(row[:plen], max_new_tokens=12, ignore_eos=True).tokens == row[plen:]
    retrain_drafters.main(argv)
    again = json.loads((out / "ship" / "retrain_facts.json").read_text())["selfgen"]
    assert again["reused"] and again["sequences"] == 5

    models = tmp_path / "models"
    export.join(built["out"] / "ship", models, tmp_path / "data")
    retrain_drafters.join(out / "ship", models)
    run = json.loads((models / "card_facts.json").read_text())["drafters"]["retrained"][-1]
    assert run["data"] == "self" and run["selfgen"]["sequences"] == 5
    assert "own greedy continuations of training-code prefixes (5 sequences x 12 tokens)" in \
        (models / "MODEL_CARD.md").read_text()


def test_self_batches_anchor_after_the_prompt():
    """SelfBatches serves each group (in parts of ``batch`` rows) with its prompt length as the first anchor; Mixed
    serves them for its fraction of the steps and corpus rows for the rest; ``anchors`` draws only from the first
    anchor to the last block that fits."""
    from bundled import selfgen

    data = {"groups": [np.arange(3 * 20).reshape(3, 20), np.arange(2 * 30).reshape(2, 30)],
            "prompt_lengths": [8, 18], "new_tokens": 12}
    b = selfgen.SelfBatches(data, batch=2, seed=0)
    seen = [b.next() for _ in range(6)]
    assert sorted((x.shape, lo) for x, lo in seen[:3]) == [((1, 20), 8), ((2, 20), 8), ((2, 30), 18)]
    corpus_rows = batches.Batches(np.arange(500) % 97, 16, 2, 0, 0.0, None, np.zeros(97, bool))
    mixed = selfgen.Mixed(selfgen.SelfBatches(data, batch=2, seed=1), corpus_rows, 0.75, seed=0)
    got = [mixed.next() for _ in range(400)]
    own = sum(isinstance(g, tuple) for g in got)
    assert 0.68 < own / 400 < 0.82 and all(g.shape == (2, 17) for g in got if not isinstance(g, tuple))
    gen = torch.Generator().manual_seed(0)
    a = drafters.anchors(4, 29, 8, 100, gen, "cpu", lo=18)
    assert a.min() >= 18 and a.max() <= 29 - 8 + 1 and a.shape == (4, 29 - 8 + 2 - 18)
    assert all(len(set(r.tolist())) == r.numel() for r in a)


def test_self_generation_prompts_are_document_prefixes_cut_at_line_ends():
    """prefixes: the start of a document, never past its end, cut back to a line end; groups: equal lengths, each
    prompt cut from the front (so it still ends where it ended)."""
    from bundled import selfgen

    nl = np.zeros(16, bool)
    nl[5] = True  # token 5 is a newline; 0 ends a document
    rng = np.random.default_rng(0)
    docs = [np.where(np.arange(n) % 4 == 3, 5, rng.integers(6, 16, n)) for n in (10, 14, 20, 25, 30, 41)]
    stream = np.concatenate([np.concatenate([d, [0]]) for d in docs]).astype(np.uint16)
    opts = selfgen.GenOptions(sequences=10, new_tokens=4, batch=2, prompt_tokens=(8, 40), budget_s=60)
    got = selfgen.prefixes(stream, 0, nl, opts)
    assert len(got) >= 3 and all(p[-1] == 5 and 0 not in p and len(p) >= 8 for p in got)
    starts = {tuple(d[:len(p)]) for d in docs for p in got if len(p) <= len(d)}
    assert all(tuple(p) in starts for p in got)
    for g, part in zip(selfgen.groups(got, 2), [sorted(got, key=len)[i:i + 2] for i in range(0, len(got), 2)]):
        assert all(list(row) == list(p[len(p) - g.shape[1]:]) for row, p in zip(g, part))


def test_path_labels_count_a_block_position_only_after_greedy_corpus_tokens():
    # corpus ids and the target's greedy labels: greedy[p] predicts ids[p + 1]
    ids = torch.tensor([[5, 1, 2, 3, 4, 6, 7, 8, 9]])
    greedy = torch.tensor([[1, 2, 0, 4, 6, 0, 8, 9, 0]])  # wrong at 2 (ids[3] = 3) and at 5 (ids[6] = 7)
    a = torch.tensor([[1, 3, 4]])  # anchors
    s = 5
    lab = greedy.gather(1, (a[..., None] + torch.arange(s - 1)).view(1, -1)).view(1, 3, s - 1)
    got = drafters.on_path(ids, a, lab)
    # anchor 1: labels 2 (ok: ids[2] = 2), 0 (ids[3] = 3: off), ...; anchor 3: 4 ok, 6 ok, 0 off; anchor 4: 6 ok, 0 off
    assert got.tolist() == [[[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]]]


def test_schedule_budget_survives_slow_steps_after_calibration(monkeypatch):
    """Rows of many lengths compile kernels well past the first steps: a few slow steps after the first two must not
    shrink the phase's total to a fraction of what its budget holds (the median step time sets it)."""
    from bundled import schedule

    now = [0.0]
    monkeypatch.setattr(schedule.time, "perf_counter", lambda: now[0])
    s = schedule.Schedule(1e-3, warmup=5, budget_s=100.0, start=0.0)
    step, slow = 0, {1: 5.0, 2: 5.0, 7: 4.0, 12: 6.0, 25: 3.0, 33: 5.0}  # compile steps, seconds
    while True:
        now[0] += slow.get(step + 1, 0.1)
        step += 1
        if s.done(step):
            break
    assert s.total is not None and 500 < s.total < 900, s.total  # ~72 s left at 0.1 s a step after the slow ones
    assert step == s.total and s.elapsed <= 100.0
    assert s.lr(step - 1) < 0.2e-3  # the cosine reached its end with the budget
    fixed = schedule.Schedule(1e-3, warmup=5, budget_s=100.0, max_steps=30, start=now[0])
    assert all(not fixed.done(i) for i in range(1, 30)) and fixed.done(30) and fixed.total == 30
