"""Per-session sampling randomness: a session's samples depend on (seed, session id, step) only.

Why: a rollout batch may be split over several engines (``rollout.shards``, or
``engine_options.base_urls``). If an engine drew its random numbers from ONE stream for the whole
batch (row ``b`` takes the ``b``-th number), an episode's tokens would depend on which other
episodes share its batch and on their order, so sharding would change the trajectories. Keying the
randomness on the session id instead makes an episode's samples the same in any batch.

* ``session_seed(seed, session_id)``: a 63-bit seed for one session of one seeded call (the
  OpenAI/vLLM engines send it as the request's ``seed``; the HF engine uses it as a stream key).
  blake2b of the text ``"{seed}:{session_id}"``: stable across processes and machines (never
  ``hash()``, which is salted per process).
* ``uniforms(keys, step)``: one uniform number in ``[0, 1)`` per key for decode step ``step``:
  SplitMix64 (Steele, Lea & Flood 2014) in counter mode, i.e. output ``step + 1`` of the SplitMix64
  stream seeded with ``key``. Vectorised over the batch in numpy; 24 random bits per number, the
  same grid as ``torch.rand``'s float32 (``k / 2**24``), so the sampling law is unchanged.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 / golden ratio, odd)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


def session_seed(seed: int, session_id: str) -> int:
    """A seed in ``[0, 2**63)`` for session ``session_id`` of a call seeded with ``seed`` (int64-safe,
    as vLLM's request ``seed`` requires)."""
    digest = hashlib.blake2b(f"{int(seed)}:{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def session_keys(seed: int, session_ids: list[str]) -> npt.NDArray[np.uint64]:
    """``session_seed`` of each session, as a (B,) uint64 array (the keys of ``uniforms``)."""
    return np.array([session_seed(seed, sid) for sid in session_ids], dtype=np.uint64)


def uniforms(keys: npt.NDArray[np.uint64], step: int) -> npt.NDArray[np.float32]:
    """(B,) float32 in ``[0, 1)``: the ``step``-th uniform of each key's stream (step >= 0).

    Each entry depends only on its own key and ``step``, never on the other keys in the batch.
    uint64 array arithmetic wraps modulo 2**64, which is what SplitMix64 needs.
    """
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    # (B,) the stream's state after step + 1 increments (the offset mod 2**64 in Python ints: numpy
    # scalars warn on overflow, arrays wrap silently)
    z = keys + np.uint64(((step + 1) * _GOLDEN) & _MASK64)
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    # the top 24 bits -> k / 2**24, exactly representable in float32 and < 1
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
