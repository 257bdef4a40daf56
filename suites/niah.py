"""Needle in a haystack: a key -> value line hidden at a depth of a code haystack, the question at the end.

Each case (context length x depth x case index) is built deterministically from the shipped haystack
(``suites/data/haystack.py.txt``, CPython standard-library code) and the retrieval format of
``suites/needle.py`` (the one the bundled model was trained with). The engine answers greedily; the answer
is scored two ways: retrieval (does it hold the needle's value) and oracle agreement (docs/DESIGN.md, "Metrics": greedy
tokens identical to the stored float64 reference outputs, or a first divergence at a near tie).
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..engine.runtime.options import EngineOptions, switch_labels
from ..oracles.store import NEAR_TIE_NATS, agreement, identity_mismatch, kl, load_oracle
from ..reports.schema import make_result
from .common import CODE_TEXT, code_prompt, flat_config, forward_flops, measured_matmul_peak, split_options
from .needle import make_needle, needle_text, question_text

HAYSTACK = CODE_TEXT
ORACLE_DIR = Path(__file__).resolve().parent.parent / "oracles" / "data"
DEFAULT_DEPTHS = tuple(range(0, 101, 10))


@dataclass(slots=True)
class NiahOptions:
    """Everything a NIAH run depends on (recorded flat as the result's ``config``). ``engine_options``: the engine's
    (its ``max_context`` is the longest context), and the prefill chunk an oracle build's reference model takes."""

    model: str | None = None
    ctxs: tuple[int, ...] = (65536,)
    depths: tuple[int, ...] = DEFAULT_DEPTHS
    cases: int = 1
    answer_tokens: int = 10
    engine_options: EngineOptions = field(default_factory=EngineOptions)
    seed: int = 0
    oracle: str | None = None  # a file, or None: look in oracles/data for the model's file per context
    near_tie: float = NEAR_TIE_NATS
    label: str | None = None
    # a generation before the cases, so the first case's TTFT holds no first-use costs (compiles, graph captures,
    # the long prompt's first allocations): N > 0, a prompt of N tokens cut from the shipped code text; None, on CUDA
    # the longest case's own prompt (every key length the cases reach) and on the CPU none (no first-use costs worth
    # a prefill); 0: no warm-up
    warmup_prompt: int | None = None

    @classmethod
    def make(cls, **kw) -> "NiahOptions":
        """Options from one flat set of keywords: the suite's fields, the rest :class:`EngineOptions`'."""
        return split_options(cls, kw)

    def __post_init__(self) -> None:
        self.ctxs = tuple(int(c) for c in self.ctxs)
        self.depths = tuple(int(d) for d in self.depths)
        if any(c < 64 for c in self.ctxs):
            raise ValueError(f"context lengths must be >= 64 tokens, got {self.ctxs}")
        if any(not 0 <= d <= 100 for d in self.depths):
            raise ValueError(f"depths are percentages in 0..100, got {self.depths}")
        if self.cases < 1 or self.answer_tokens < 1:
            raise ValueError("cases and answer-tokens must be >= 1")
        w = self.warmup_prompt
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise ValueError(f"--warmup-prompt takes a prompt length in tokens (0: no warm-up), got {w!r}")


_LINES: dict[int, tuple] = {}


def _haystack_lines(tokenizer) -> tuple[tuple[int, ...], ...]:
    """The haystack's lines, each tokenized on its own (cached per tokenizer object)."""
    key = id(tokenizer)
    if key not in _LINES:
        lines = HAYSTACK.read_text().splitlines(keepends=True)
        _LINES[key] = (tokenizer, tuple(tuple(tokenizer.encode(line)) for line in lines))
    return _LINES[key][1]


def build_case(tokenizer, ctx: int, depth: int, index: int, seed: int = 0, answer_tokens: int = 10) -> dict:
    """One case: prompt ids of at most ``ctx - answer_tokens`` tokens with the needle at ``depth`` percent."""
    rng = np.random.default_rng([seed, ctx, depth, index])
    key, value = make_needle(rng)
    needle = tokenizer.encode(needle_text(key, value))
    question = tokenizer.encode("\n" + question_text(key))
    budget = ctx - answer_tokens - len(needle) - len(question)
    lines = _haystack_lines(tokenizer)
    body: list[list[int]] = []
    used, i = 0, 0
    while used < budget:  # whole lines, repeating the haystack if a context is longer than it
        line = lines[i % len(lines)]
        if used + len(line) > budget:
            break
        body.append(list(line))
        used += len(line)
        i += 1
    at = needle_line(body, depth)
    ids = [t for line in body[:at] for t in line] + needle + [t for line in body[at:] for t in line] + question
    return {"case": f"ctx{ctx}-d{depth}-{index}", "ctx": ctx, "depth": depth, "key": key, "value": value,
            "prompt_ids": ids}


def needle_line(body: list[list[int]], depth: int) -> int:
    """The line boundary the needle goes in front of: the one whose token offset is nearest ``depth`` percent of
    the body's tokens (the lower one on a tie). Lines differ in length, so a share of the lines (``depth`` percent
    of the line count) can sit several points of the context away from where the case says its needle is."""
    starts = np.concatenate([[0], np.cumsum([len(line) for line in body])])  # [lines + 1] token offsets
    return int(np.argmin(np.abs(starts * 100 - starts[-1] * depth)))  # integers: no float ties


NEEDLE_PLACEMENT = "tokens"
"""How ``build_case`` places a needle (recorded in a result's config): at the line boundary nearest the depth's
share of the body's tokens. Documents made before (no such key: by share of lines) have other prompts at most
depths, so ``--rescore`` cannot rebuild their cases."""


def cases(tokenizer, opts: NiahOptions) -> list[dict]:
    return [build_case(tokenizer, c, d, i, opts.seed, opts.answer_tokens)
            for c in opts.ctxs for d in opts.depths for i in range(opts.cases)]


def oracle_path(model_info: dict, ctx: int) -> Path:
    """Where the stored oracle of a model for one context length lives: named by the text model's identity
    (``loader.text_identity``: an artifact whose drafters were replaced keeps its oracles), else by artifact id
    (v2) or preset."""
    ident = (model_info.get("text_id") or model_info.get("artifact_id") or model_info.get("preset") or "model")[:16]
    return ORACLE_DIR / f"niah-{ident}-{ctx}.json.gz"


def _load_oracles(opts: NiahOptions, model_info: dict) -> dict[str, dict]:
    """The stored oracle records for ``opts``'s cases, by case id; a file made for another model, or for cases
    built with another seed or answer length (other prompts), is refused naming what differs."""
    paths = [Path(opts.oracle)] if opts.oracle else [oracle_path(model_info, c) for c in opts.ctxs]
    out = {}
    for p in paths:
        if p.is_file():
            records, meta = load_oracle(p)
            if meta.get("suite") != "niah":  # (`oracle prompts` files name no suite)
                raise ValueError(f"{p}: not an oracle of needle-in-a-haystack cases (suite "
                                 f"{meta.get('suite')!r}): make one with `ninfer-bench oracle niah`")
            if why := identity_mismatch(meta, model_info):
                raise ValueError(f"{p}: {why}")
            differ = [f"{k} {meta[k]} (this run: {getattr(opts, k)})" for k in ("seed", "answer_tokens")
                      if k in meta and meta[k] != getattr(opts, k)]
            if differ:
                raise ValueError(f"{p}: oracle cases built with {', '.join(differ)}: its prompts are not this "
                                 f"run's")
            out.update({r["id"]: r for r in records})
    return out


def retrieved(text: str, value: int) -> bool:
    """The answer holds the value (docs/DESIGN.md, "Metrics") as a whole number on the answer's first line."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    digits = "".join(ch if ch.isdigit() else " " for ch in first).split()
    return str(value) in digits


def judge(rec: dict, case: dict, oracle: dict | None, near_tie: float, logprobs=None) -> dict:
    """``rec`` with the oracle verdict of its tokens (``pass`` None when there is no stored oracle output) and, given
    the engine's log-softmax rows of its tokens (``logprobs``), ``kl``: the mean over the steps on the oracle's own
    path (before the first divergence) of KL(oracle || engine) on the oracle's top-k ids (``oracles.store.kl``)."""
    if oracle is None:
        rec.update({"pass": None, "first_divergence": None, "top1_agreement": None, "gap_at_divergence": None,
                    "kl": None})
        return rec
    if oracle["prompt_ids"] != case["prompt_ids"]:
        raise ValueError(f"oracle for {case['case']} was made for a different prompt (tokenizer or haystack "
                         f"changed): regenerate it with `ninfer-bench oracle niah`")
    ag = agreement(rec["tokens"], oracle, near_tie=near_tie)
    rec.update({"pass": ag["pass"], "first_divergence": ag["first_divergence"], "top1_agreement": ag["top1_agreement"],
                "gap_at_divergence": ag["gap_at_divergence"], "oracle_tokens": oracle["tokens"],
                "kl": path_kl(oracle, logprobs, ag["compared_steps"] if ag["first_divergence"] is None
                              else ag["first_divergence"])})
    return rec


def path_kl(oracle: dict, logprobs, steps: int) -> float | None:
    """Mean KL(oracle || engine) over the first ``steps`` generated positions, on the oracle's top-k ids there (None
    without the engine's rows, or with no step on the oracle's path)."""
    if not logprobs or steps == 0:
        return None
    vals = [kl(oracle["topk_logprobs"][i], [float(logprobs[i][int(t)]) for t in oracle["topk_ids"][i]])
            for i in range(min(steps, len(logprobs)))]
    return float(np.mean(vals)) if vals else None


def summarize(records: list[dict], ctxs, seconds: float) -> dict:
    judged = [r for r in records if r["pass"] is not None]
    return {
        "cases": len(records),
        "oracle_cases": len(judged),
        "oracle_agreement": sum(r["pass"] for r in judged) / len(judged) if judged else None,
        "retrieval": sum(r["retrieved"] for r in records) / len(records),
        "first_divergence": {r["case"]: r["first_divergence"] for r in judged},
        "kl_mean": float(np.mean(kls)) if (kls := [r["kl"] for r in judged if r.get("kl") is not None]) else None,
        "retrieval_by_ctx": {str(c): float(np.mean([r["retrieved"] for r in records if r["ctx"] == c]))
                             for c in ctxs},
        # each context's median TTFT and prefill speed over its cases (a server's run, or an older document, may
        # not have them)
        "ttft_ms_by_ctx": _median_by_ctx(records, ctxs, "ttft_ms"),
        "prefill_tok_s_by_ctx": _median_by_ctx(records, ctxs, "prefill_tok_s"),
        "seconds": seconds,
    }


def _median_by_ctx(records: list[dict], ctxs, key: str) -> dict[str, float | None]:
    out = {}
    for c in ctxs:
        values = [r[key] for r in records if r["ctx"] == c and r.get(key) is not None]
        out[str(c)] = float(np.median(values)) if values else None
    return out


RESCORE_CONFIG = ("ctxs", "depths", "cases", "answer_tokens", "seed")  # what rebuilds a document's cases
RESCORE_RECORD = ("case", "ctx", "depth", "prompt_tokens", "answer", "tokens", "retrieved")  # what run_niah wrote


def rescore_niah(doc: dict, oracle: str | None = None) -> dict:
    """A niah result document judged again against the oracle outputs stored now (e.g. a GPU grid run before its
    64K oracles existed): same cases, same tokens, new verdicts. Each case is rebuilt from the document's config
    and must equal the stored oracle's prompt, so a changed tokenizer or haystack is refused."""
    from ..engine.artifact.loader import load_source

    if doc.get("suite") != "niah":
        raise ValueError(f"--rescore takes a niah result document, this one is {doc.get('suite')!r}")
    cfg = doc["config"]
    lacking = [k for k in RESCORE_CONFIG if k not in cfg]
    if lacking:
        raise ValueError(f"niah result {doc.get('label')!r}: its config lacks {lacking}; its cases cannot be rebuilt")
    for i, rec in enumerate(doc["records"]):
        lacking = [k for k in RESCORE_RECORD if k not in rec]
        if lacking:
            raise ValueError(f"niah result {doc.get('label')!r}: records[{i}] lacks {lacking}")
    if cfg.get("needle_placement") != NEEDLE_PLACEMENT:
        raise ValueError(f"niah result {doc.get('label')!r}: its needles were placed by share of lines (before "
                         f"placement by tokens): this build's cases are other prompts, its tokens cannot be rescored")
    opts = NiahOptions(model=cfg.get("model"), ctxs=tuple(cfg["ctxs"]), depths=tuple(cfg["depths"]),
                       cases=cfg["cases"], answer_tokens=cfg["answer_tokens"], seed=cfg["seed"],
                       oracle=oracle or None, near_tie=cfg.get("near_tie", NEAR_TIE_NATS))
    tokenizer = load_source(opts.model).tokenizer
    oracles = _load_oracles(opts, doc["model"])
    by_case = {c["case"]: c for c in cases(tokenizer, opts)}
    records = []
    for rec in doc["records"]:
        case = by_case.get(rec["case"])
        if case is None:
            raise ValueError(f"case {rec['case']} is not one of the document's own cases: is the config intact?")
        records.append(judge(dict(rec), case, oracles.get(rec["case"]), opts.near_tie))
    out = {**doc, "records": records, "summary": summarize(records, opts.ctxs, doc["summary"].get("seconds", 0.0))}
    out["config"] = {**cfg, "rescored_with": oracle or "oracles/data (default paths)"}
    return out


def warmup_ids(opts: NiahOptions, device_type: str, max_context: int, all_cases: list[dict], tokenizer) -> list[int]:
    """The warm-up's prompt ids for a run on ``device_type`` (:attr:`NiahOptions.warmup_prompt`; empty: none): a
    code prompt kept within the engine's context with the answer's tokens after it, or the longest case's prompt."""
    w = opts.warmup_prompt
    if w is None:
        if device_type != "cuda" or not all_cases:
            return []
        return list(max(all_cases, key=lambda c: len(c["prompt_ids"]))["prompt_ids"])
    w = max(0, min(w, max_context - opts.answer_tokens))
    return code_prompt(tokenizer, w) if w else []


def niah_label(opts: NiahOptions) -> str:
    """A run's default label: the runtime, a switch away from its default (``-nocudnnpast``), the ranks."""
    eo = opts.engine_options
    return f"{eo.runtime}-niah{switch_labels(eo)}" + (f"-tp{eo.tensor_parallel}" if eo.tensor_parallel > 1 else "")


def run_niah(opts: NiahOptions, progress=None) -> dict:
    """Run every case; returns the result document (heatmap drawing is left to reports).

    ``progress(done, total, what)`` counts prompt tokens prefilled over all cases, chunk by chunk: one 64K case
    prefills for minutes on a CPU, and a count of finished cases alone would stand still meanwhile."""
    from ..engine.artifact.loader import load_source
    from ..engine.runtime.engine import Engine

    top = max(opts.ctxs)
    if progress:
        progress(0, None, "loading the model")
    eo = dataclasses.replace(opts.engine_options, max_context=top)
    eng = Engine(load_source(opts.model, device=eo.torch_device), eo)
    all_cases = cases(eng.tokenizer, opts)
    oracles = _load_oracles(opts, eng.model_info)
    warm_ids = warmup_ids(opts, eng.device.type, top, all_cases, eng.tokenizer)
    warm, warm_s = len(warm_ids), 0.0
    if warm:
        if progress:
            progress(0, None, f"warming up on a {warm:,}-token prompt")
        w0 = time.perf_counter()
        eng.generate(warm_ids, max_new_tokens=opts.answer_tokens, ignore_eos=True)
        warm_s = time.perf_counter() - w0
    total = sum(len(c["prompt_ids"]) for c in all_cases)
    records, before, t0 = [], 0, time.perf_counter()
    for n, case in enumerate(all_cases, 1):
        what = f"prompt tokens, case {n}/{len(all_cases)} {case['case']}"

        def on_prefill(done, _case_total, at=before, what=what):
            progress(at + done, total, what)

        if progress:
            on_prefill(0, None)
        oracle = oracles.get(case["case"])
        res = eng.generate(case["prompt_ids"], max_new_tokens=opts.answer_tokens, ignore_eos=True,
                           on_prefill=on_prefill if progress else None, logprobs=oracle is not None)
        before += len(case["prompt_ids"])
        rec = {k: case[k] for k in ("case", "ctx", "depth", "key", "value")}
        rec.update(prompt_tokens=len(case["prompt_ids"]), answer=res.text, tokens=res.tokens,
                   retrieved=retrieved(res.text, case["value"]), seconds=res.prefill_s + res.decode_s,
                   ttft_ms=res.ttft_s * 1e3,
                   prefill_tok_s=len(case["prompt_ids"]) / res.prefill_s if res.prefill_s else None,
                   prefill_tflops=forward_flops(eng.config, len(case["prompt_ids"])) / res.prefill_s / 1e12
                   if res.prefill_s else None)
        records.append(judge(rec, case, oracle, opts.near_tie, res.logprobs))
    summary = summarize(records, opts.ctxs, time.perf_counter() - t0)
    # the prefill against the compute roofline, as the decode suite sets it (suites/decode.py's summary)
    peak = measured_matmul_peak(str(eng.device), eng.dtype)
    summary["matmul_tflops"] = peak / 1e12 if peak else None
    summary["prefill_compute_fraction_by_ctx"] = {
        c: (v / summary["matmul_tflops"] if v is not None and peak else None)
        for c, v in _median_by_ctx(records, opts.ctxs, "prefill_tflops").items()}
    config = flat_config(opts)
    config["label"] = opts.label or niah_label(opts)
    config["device"] = str(eng.device)
    config.update(eng.recorded)  # the settings as the engine applies them
    config["needle_placement"] = NEEDLE_PLACEMENT
    config["warmup_prompt"] = warm  # as run (the option's None resolved)
    config["warmup_s"] = round(warm_s, 3)
    return make_result("niah", label=config["label"], config=config, records=records, summary=summary,
                       model=dict(eng.model_info))


NIAH_SETTINGS = ("suite", "ctx", "dtype", "top_k", "seed", "answer_tokens")
"""What an oracle file's cases were built with besides the model: a run that differs in any of them makes cases
that cannot sit with the stored ones (``--cases`` and ``--depths`` only add cases, ``--prefill-chunk`` only
schedules the same computation)."""


def _case_key(case_id: str) -> tuple[int, int, int] | None:
    """(ctx, depth, index) of a case id made by ``build_case``, or None for any other id."""
    m = re.fullmatch(r"ctx(\d+)-d(\d+)-(\d+)", case_id)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def _stale_prompt(records: list[dict], tokenizer, ctx: int, seed: int, answer_tokens: int) -> str | None:
    """Why the first stored record that these settings would not build as it is stored (another context's case,
    or a prompt that changed with the tokenizer or the haystack) cannot stay, or None."""
    for rec in records:
        key = _case_key(rec["id"])
        if key is None or key[0] != ctx:
            return f"case {rec['id']!r} is not a case of context {ctx}"
        if build_case(tokenizer, *key, seed, answer_tokens)["prompt_ids"] != rec["prompt_ids"]:
            return f"case {rec['id']}'s stored prompt is not the one built now (tokenizer or haystack changed)"
    return None


def _stored_cases(path: Path, meta: dict, info: dict, tokenizer) -> dict[str, dict]:
    """The records of the oracle file at ``path`` when this build may extend it (same model, same settings, every
    stored prompt the one these settings build now); otherwise ValueError naming what differs. Checked before any
    reference compute: a file's 64K cases took hours of float64 work, and a rebuild for another model or settings
    used to replace them silently."""
    old, old_meta = load_oracle(path)
    differ = [f"{k} {old_meta.get(k)!r} (this run: {meta[k]!r})" for k in NIAH_SETTINGS if old_meta.get(k) != meta[k]]
    if why := identity_mismatch(old_meta, info):
        differ.insert(0, why)
    if not differ and (why := _stale_prompt(old, tokenizer, meta["ctx"], meta["seed"], meta["answer_tokens"])):
        differ.append(why)
    if differ:
        raise ValueError(f"{path}: holds oracle cases this run cannot add to: {'; '.join(differ)}. "
                         f"--force replaces the file, dropping its cases")
    return {r["id"]: r for r in old}


def _coverage(records) -> dict:
    """``depths`` (every depth the file holds) and ``cases`` (the fewest cases any of them has: runs with
    different ``--cases`` extend one file) of a file's records."""
    per_depth: dict[int, int] = {}
    for rec in records:
        depth = _case_key(rec["id"])[1]
        per_depth[depth] = per_depth.get(depth, 0) + 1
    return {"depths": sorted(per_depth), "cases": min(per_depth.values(), default=0)}


def build_niah_oracle(source: str | None, opts: NiahOptions, out: str | None = None, *, top_k: int = 8,
                      dtype: str = "fp64", force: bool = False, device: str = "cpu", progress=None) -> list[Path]:
    """Reference-model (float64, sequential) greedy answers for every case; one file per context length.

    A file that exists for the same model and settings is extended: its cases stay, and the ones asked for again
    are reused rather than recomputed (a 64K case takes minutes). A file made for another model or other settings
    is refused, before any compute, naming what differs; ``force`` replaces the file instead (its cases are dropped
    and the requested ones computed afresh)."""
    from ..oracles.build import model_meta, reference_model
    from ..oracles.store import save_oracle

    if out and len(opts.ctxs) != 1:
        raise ValueError(f"out names one oracle file, for one context length; got {len(opts.ctxs)}")
    model, loaded = reference_model(source, dtype, device)
    info = loaded.info
    plan = []  # (path, meta, stored records) per context, every file checked before the first case is computed
    for ctx in opts.ctxs:
        path = Path(out) if out else oracle_path(info, ctx)
        meta = {**model_meta(info), "dtype": dtype, "top_k": top_k, "suite": "niah", "ctx": ctx, "seed": opts.seed,
                "answer_tokens": opts.answer_tokens}
        kept = _stored_cases(path, meta, info, loaded.tokenizer) if path.is_file() and not force else {}
        plan.append((path, meta, kept))
    written, done, total = [], 0, len(opts.ctxs) * len(opts.depths) * opts.cases
    for path, meta, kept in plan:
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in opts.depths:
            computed = False
            for i in range(opts.cases):
                case = build_case(loaded.tokenizer, meta["ctx"], d, i, opts.seed, opts.answer_tokens)
                if case["case"] not in kept:
                    res = model.greedy(case["prompt_ids"], opts.answer_tokens, top_k=top_k,
                                       prefill_chunk=opts.engine_options.prefill_chunk)
                    kept[case["case"]] = {"id": case["case"], "prompt_ids": case["prompt_ids"], **res,
                                          "device": model.device.type}  # a CPU-built file may gain GPU cases
                    computed = True
                done += 1
                if progress:
                    progress(done, total, case["case"])
            if computed:  # saved depth by depth: an interrupted 64K build keeps every depth it finished
                save_oracle(path, list(kept.values()), {**meta, **_coverage(kept.values())})
        if not path.is_file():  # (no depths asked for)
            save_oracle(path, list(kept.values()), {**meta, **_coverage(kept.values())})
        written.append(path)
    return written
