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
* ``uniforms(keys, steps)``: ``(B, steps)`` uniform numbers in ``[0, 1)``, entry ``[b, t]`` for key
  ``b`` at decode step ``t``: SplitMix64 (Steele, Lea & Flood 2014) in counter mode, i.e. output
  ``t + 1`` of the SplitMix64 stream seeded with the key. One vectorised numpy computation per
  generate call (the engine indexes a column per step: cheaper than a ``torch.rand`` per step);
  24 random bits per number, the same grid as ``torch.rand``'s float32 (``k / 2**24``), so the
  sampling law is unchanged.
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


def uniforms(keys: npt.NDArray[np.uint64], steps: int) -> npt.NDArray[np.float32]:
    """(B, steps) float32 in ``[0, 1)``: entry ``[b, t]`` is the ``t``-th uniform of key ``b``'s stream.

    Each row depends only on its own key, never on the other keys in the batch; column ``t`` does
    not depend on ``steps``. uint64 array arithmetic wraps modulo 2**64, which SplitMix64 needs.
    """
    if steps < 0:
        raise ValueError(f"steps={steps} must be >= 0")
    # (steps,) offsets (t + 1) * golden mod 2**64, in Python ints (numpy scalars warn on overflow)
    offsets = np.array([((t + 1) * _GOLDEN) & _MASK64 for t in range(steps)], dtype=np.uint64)
    z = keys[:, None] + offsets[None, :]  # (B, steps) the stream's state after t + 1 increments
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    # the top 24 bits -> k / 2**24, exactly representable in float32 and < 1
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
