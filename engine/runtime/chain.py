"""The chained greedy decode: plain greedy decoding through the captured decode graph with the host one step behind
the GPU (``EngineOptions.lookahead``). Step n + 1 is queued before token n is read, so the GPU never waits for the
host's bookkeeping; the graph itself stops writing the sequence's state once a stop id comes out
(:meth:`.graphs.GraphRunner.chain`). Same tokens as :meth:`.runtime.Engine.advance` (the same argmax)."""

from __future__ import annotations

import torch

from .sequence import Sequence


def chainable(engine, seq: Sequence) -> bool:
    """Whether ``seq`` can decode through the graph chain: greedy, no drafter, no log-probabilities, no stop
    strings (the host finds those only in the text), no media rotary shift, CUDA graphs captured, lookahead on."""
    from ..model.graphs import MAX_STOP_IDS  # (imported when used, as the runtime imports the graphs)

    p = seq.params
    return (engine.options.lookahead and engine.graphs is not None and engine.drafter is None and p.greedy
            and not p.keeps_logprobs and not p.stop and not (seq.media is not None and seq.media.delta)
            and seq.finish_reason is None and len(engine.stops.stop_ids(p)) <= MAX_STOP_IDS)


@torch.inference_mode()  # the decode graph may have been captured (its buffers made) in inference mode
def decode_chained(engine, seq: Sequence) -> None:
    """Greedy decode of ``seq`` (:func:`chainable`) until it finishes. The steps are never more than the tokens
    still allowed (``max_new_tokens``); when token n is a stop id the GPU already knows it, and step n + 1 (queued)
    writes the scratch slot instead of the sequence's (its state stays that of the tokens kept)."""
    left = seq.params.max_new_tokens - len(seq.tokens)
    if left <= 0:
        return
    graphs = engine.graphs
    ch = graphs.chain(seq.last, seq.length, seq.slot, engine.stops.stop_ids(seq.params))
    host = torch.empty(left, dtype=torch.long, pin_memory=True)
    done = []
    queued = read = 0
    while seq.finish_reason is None:
        if queued < left and queued <= read + 1:
            graphs.step(ch)
            if engine.step_delay:  # testing only (EngineOptions.inject_delay_us): before the token's copy
                engine.step_delay()
            host[queued:queued + 1].copy_(ch.tok, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            done.append(ev)
            queued += 1
            if queued <= read + 1:  # keep one step queued ahead of the read
                continue
        done[read].synchronize()
        tok = int(host[read])
        read += 1
        seq.length += 1
        seq.tokens.append(tok)
        engine.stops.finish(seq)
