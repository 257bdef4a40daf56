"""Replayed acceptance: speculative rounds measured at a chosen acceptance on weights that cannot draft.

Random (``--synthetic``) weights give a drafter nothing to agree with: every draft is rejected and a round costs
what it costs without ever paying back. To measure a release-shaped round anyway, the drafter runs its whole
computation and then, on the device, each proposal i is replaced by the plain greedy continuation (a plain run's
tokens on the same prompt, in the same process) with conditional probability ``p_i`` - given proposals before i
were accepted - and otherwise by a token certain to be rejected (the continuation's token plus one). Verification
is the target's own: since a verify pass computes what single decode steps compute, an accepted proposal is the
target's greedy token, and the output stays plain decoding's, token for token.

Profiles (``EngineOptions.replay_acceptance``):

- ``seed``: one constant ``p`` for every position, solved so that ``1 + sum_i p^i`` (the expected tokens a round)
  is the release's own: 5.16 for DFlash2 (and DFlash) K = 7, 3.37 for MTP K = 3 (213.17 tok/s x 24.203 ms and
  147.56 x 22.843 ms); other K take the same ``p`` as their drafter kind's K;
- a number in [0, 1]: that constant ``p``;
- a ``.json`` file: a list of ``p_i``, one a draft position (at least K).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# the release's tokens per round at its own K, by drafter kind
RELEASE_TOKENS_PER_ROUND = {"dflash2": (7, 5.16), "dflash": (7, 5.16), "mtp": (3, 3.37)}


def constant_p(k: int, tokens_per_round: float) -> float:
    """The constant conditional acceptance ``p`` with ``1 + p + p^2 + ... + p^k = tokens_per_round``."""
    want = tokens_per_round - 1
    if not 0 <= want <= k:
        raise ValueError(f"{tokens_per_round} tokens a round cannot come from {k} drafts")
    lo, hi = 0.0, 1.0
    for _ in range(100):  # bisection: the sum grows with p
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, k + 1)) < want:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def check_value(value: str) -> None:
    """Refuse, before any work, a profile that is none of ``seed``, a number in [0, 1] or a readable .json file."""
    profile(value, "dflash2", 1, check_only=True)


def profile(value: str, spec: str, k: int, *, check_only: bool = False) -> list[float]:
    """The per-position conditional acceptance ``[p_0 .. p_{k-1}]`` that ``value`` names for ``spec`` with K = k."""
    if value == "seed":
        if spec not in RELEASE_TOKENS_PER_ROUND:
            raise ValueError(f"--replay-acceptance seed has no release profile for --spec {spec}")
        return [constant_p(*RELEASE_TOKENS_PER_ROUND[spec])] * k
    try:
        p = float(value)
    except ValueError:
        p = None
    if p is not None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"--replay-acceptance {value}: a constant acceptance is a probability in [0, 1]")
        return [p] * k
    path = Path(value)
    if path.suffix != ".json" or not path.is_file():
        raise ValueError(f"--replay-acceptance {value!r}: expected seed, a probability in [0, 1], or a .json file "
                         "holding one probability a draft position")
    try:
        ps = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--replay-acceptance {value}: not a JSON list of probabilities ({e})") from None
    if not isinstance(ps, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1
                                            for x in ps):
        raise ValueError(f"--replay-acceptance {value}: expected a JSON list of probabilities in [0, 1]")
    if check_only:
        return [float(x) for x in ps]
    if len(ps) < k:
        raise ValueError(f"--replay-acceptance {value}: {len(ps)} probabilities for {k} draft positions")
    return [float(x) for x in ps[:k]]


class Replay:
    """Replaces a round's drafts on the device (see the module docstring): one seeded generator per engine, so a
    run's acceptance pattern is the same every time."""

    def __init__(self, probs: list[float], vocab: int, device, seed: int = 0):
        self.probs = probs
        self.p = torch.tensor(probs, dtype=torch.float32, device=device)  # [K]
        self.vocab = vocab
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)

    def reference(self, tokens: list[int], device) -> torch.Tensor:
        """A sequence's plain continuation as the device tensor :meth:`substitute` reads."""
        if not tokens:
            raise ValueError("replayed acceptance needs the plain run's tokens (none were given)")
        return torch.tensor(tokens, dtype=torch.long, device=device)

    def substitute(self, e, seqs, drafts: torch.Tensor) -> torch.Tensor:
        """Drafts ``[B, K]`` with each proposal i the plain continuation's token with probability p_i (given those
        before it were), else one certain to be rejected."""
        b, k = drafts.shape
        refs = [s.reference for s in seqs]
        if any(r is None for r in refs):
            raise ValueError("replayed acceptance needs each sequence's plain continuation (generate(reference=...))")
        done = e.device_ids([len(s.tokens) for s in seqs])  # the next token is the continuation's token `done`
        idx = done[:, None] + torch.arange(k, device=drafts.device)[None]  # [B, K]
        want = torch.stack([r.gather(0, i.clamp(max=r.numel() - 1)) for r, i in zip(refs, idx)])
        return self.replace(want, self.draws(b, k, drafts.device))

    def draws(self, b: int, k: int, device) -> torch.Tensor:
        """A round's uniform draws ``[B, K]`` from the engine's generator (one call a round: the same acceptance
        pattern whether the round is captured (spec/chain.py, drawn beside the graph) or not)."""
        return torch.rand(b, k, generator=self.gen, device=device)

    def replace(self, want: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Proposals ``[B, K]``: the continuation's token ``want`` where ``u < p_i``, else one certain to be
        rejected. Device tensors only: capturable."""
        take = u < self.p[: want.shape[1]]
        return torch.where(take, want, (want + 1) % self.vocab)
