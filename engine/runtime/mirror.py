"""Continuous batching under tensor parallelism: rank 0's scheduler drives every rank's engine.

Under ``--tensor-parallel N`` each rank holds a share of the model, and every forward meets the other ranks in its
all-reduces, so every rank must run the same forwards over the same sequences in the same order. The scheduler (and
the server around it) decides those from requests that arrive at rank 0 alone and at times no other rank can
predict. So rank 0's scheduler gets a :class:`MirroredEngine`: each call that changes which sequences hold slots or
runs a forward - ``acquire``, ``release``, ``prefill_steps``, ``advance`` - is sent to the other ranks
(``torch.distributed.broadcast_object_list``) and replayed there by :func:`follow` on their own engines, as vLLM's
workers execute its driver's scheduler output. A sequence is named by its slot (each rank's engine hands out the
same slots for the same calls: checked), and an acquired sequence's random stream (``sample_seed``, drawn on rank 0
when the request has no seed) travels with it, so sampled requests draw the same tokens on every rank.

``acquire`` runs on rank 0 first and is sent only once it succeeded (a refused request never reaches the others);
the calls with forwards are sent first, so every rank enters them together. Both ends keep each released
sequence's tokens, in release order (``released``): the launcher compares them across ranks. Not mirrored, and
refused under tensor parallelism by the callers: image / video prompts, session states, replayed acceptance.
"""

from __future__ import annotations

from ..sampling import make_generator
from .engine import Engine

__all__ = ["MirroredEngine", "follow", "lead_or_follow"]


def _send(op: tuple) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([op], src=0)


def _receive() -> tuple:
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class MirroredEngine:
    """Rank 0's engine as its scheduler sees it: :class:`Engine`'s attributes and methods, with the calls that the
    other ranks must make too sent to them first (module docstring). Attributes set on it are the engine's."""

    def __init__(self, engine: Engine):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "released", [])
        object.__setattr__(self, "stopped", False)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._engine, name, value)

    def acquire(self, prompt: list[int], params, media=None):
        if media is not None:
            raise ValueError("image and video prompts are not served under tensor parallelism (--tensor-parallel)")
        seq = self._engine.acquire(prompt, params)
        _send(("acquire", list(prompt), params, seq.slot, seq.sample_seed))
        return seq

    def release(self, seq) -> None:
        _send(("release", seq.slot))
        self.released.append(list(seq.tokens))
        self._engine.release(seq)

    def prefill_steps(self, work, on_final=None):
        _send(("prefill", [(seq.slot, n) for seq, n in work]))
        return self._engine.prefill_steps(work, on_final=on_final)

    def advance(self, seqs) -> None:
        _send(("advance", [seq.slot for seq in seqs]))
        return self._engine.advance(seqs)

    def stop(self) -> None:
        """Let the other ranks' :func:`follow` return (once; later calls do nothing)."""
        if not self.stopped:
            object.__setattr__(self, "stopped", True)
            _send(("stop",))


def follow(engine: Engine) -> list[list[int]]:
    """On a rank other than 0: replay rank 0's :class:`MirroredEngine` calls on ``engine`` until it stops; returns
    the released sequences' tokens, in release order."""
    seqs, released = {}, []
    while True:
        op = _receive()
        kind = op[0]
        if kind == "stop":
            return released
        if kind == "acquire":
            _, prompt, params, slot, seed = op
            seq = engine.acquire(prompt, params)
            if seq.slot != slot:
                raise RuntimeError(f"tensor parallel: this rank's engine gave slot {seq.slot} where rank 0's gave "
                                   f"{slot}: the ranks' engines no longer agree")
            seq.sample_seed = seed
            if seq.generator is not None:
                seq.generator = make_generator(seed, engine.device)
            seqs[slot] = seq
        elif kind == "release":
            seq = seqs.pop(op[1])
            released.append(list(seq.tokens))
            engine.release(seq)
        elif kind == "prefill":
            engine.prefill_steps([(seqs[slot], n) for slot, n in op[1]])
        elif kind == "advance":
            engine.advance([seqs[slot] for slot in op[1]])
        else:
            raise RuntimeError(f"tensor parallel: rank 0 sent an unknown call {kind!r}")


def lead_or_follow(engine: Engine, lead) -> tuple[object, list[list[int]]]:
    """This rank's part of a mirrored run: on rank 0 ``lead(MirroredEngine(engine))`` (the other ranks stopped when
    it returns or raises), elsewhere :func:`follow`. Returns (``lead``'s result, None on the other ranks; the tokens
    of the sequences this rank released, in order: equal on every rank)."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None, follow(engine)
    mirror = MirroredEngine(engine)
    try:
        result = lead(mirror)
    finally:
        mirror.stop()
    return result, mirror.released
