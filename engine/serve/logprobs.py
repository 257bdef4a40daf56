"""Log-probabilities for the OpenAI routes: each generated token's (:class:`TokenLogprob`, made by the backend from
what the engine's batched pick computed on the device: the token's log-probability and its top N), each prompt
token's with ``echo``, and OpenAI's ``logprobs`` shapes of them.

Chat completions (``logprobs: true``, ``top_logprobs: N``): ``choices[i].logprobs.content`` is one object a token,
``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``. Completions (``logprobs: N``):
``choices[i].logprobs`` is ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``; with
``echo`` the prompt's tokens come first, made by the engine's prefill (:mod:`.scoring`), the first of them with
``null`` for its log-probability and its top list (nothing comes before it), as OpenAI's legacy API gives them.
Streamed chunks carry the entries of the tokens they commit (the first, with ``echo``, the prompt's too). A token's
text is its own decoding (a token that holds part of a multi-byte character decodes to U+FFFD; ``bytes`` are that
text's UTF-8). Control tokens (end tokens, chat markers) are listed with their names, as ``return_token_ids`` lists
them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability under the distribution it was picked from (a prompt token's: the model's given
    the tokens before it), and that distribution's ``top`` most likely (id, log-probability) pairs, most likely
    first; a prompt's first token has neither (None)."""

    id: int
    logprob: float | None
    top: list[tuple[int, float]] | None


MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs


def token_logprobs(kept: list, ids: list[int]) -> list[TokenLogprob]:
    """The entries of ``ids`` from what the engine kept a token (``SamplingParams.top_logprobs``: the token's
    log-probability and its top (id, log-probability) pairs, in order)."""
    return [TokenLogprob(int(tok), float(lp), [(int(i), float(v)) for i, v in top]) for (lp, top), tok in zip(kept, ids)]


def prompt_token_logprobs(ids: list[int], rows: list[tuple[float, list[tuple[int, float]]]]) -> list[TokenLogprob]:
    """The entries of prompt ``ids`` from the engine's scores of tokens ``1 ..`` (:meth:`.scoring.PromptScores.rows`:
    own log-probability, top pairs); the first token's entry has none."""
    return [TokenLogprob(int(ids[0]), None, None)] + [TokenLogprob(int(t), lp, top)
                                                      for t, (lp, top) in zip(ids[1:], rows)]


def _text(tokenizer, tok: int) -> str:
    return tokenizer.decode([tok])


def chat_content(tokenizer, entries: list[TokenLogprob]) -> dict:
    """``choices[i].logprobs`` of a chat completion (or of one streamed chunk)."""
    def item(tok: int, lp: float) -> dict:
        text = _text(tokenizer, tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(tokenizer, entries: list[TokenLogprob], offset: int = 0) -> dict:
    """``choices[i].logprobs`` of a text completion (or of one streamed chunk whose text starts at ``offset``
    characters into the completion)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(_text(tokenizer, e.id))
        offset += len(tokens[-1])
    # as OpenAI's legacy completions: the N most likely, and the token's own (up to N + 1 entries)
    tops = [None if e.top is None else {_text(tokenizer, t): lp for t, lp in [*e.top, (e.id, e.logprob)]}
            for e in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}
