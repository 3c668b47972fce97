"""The one trajectory schema, used by rollout, the store, validation, the update and the flows.

A trajectory is one multi-turn episode, stored token-in/token-out: ``input_ids`` is exactly the
prompt ids, then for each turn the ids the policy SAMPLED followed by the observation ids the
engine FED BACK. Decoded text is kept only for reports and is never re-tokenised.

Layout of one trajectory with two turns (T tokens in all)::

    [ prompt ........ | resp_0 ....... | obs_0 ....... | resp_1 ..... ]
      response_mask 0   1                0               1
      turn_starts[0] ---^   turn_ends[0]-^  turn_starts[1]-^   turn_ends[1] = T

On disk (Parquet, see ``ARROW_SCHEMA``) token columns are ``list<int32>`` and log-probs
``list<float32>``. Bump ``SCHEMA_VERSION`` on any change of fields or meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import StrEnum

import pyarrow as pa

SCHEMA_VERSION = 1


#: Token-level lists: each has one entry per token (length T, the length of input_ids).
TOKEN_FIELDS: tuple[str, ...] = ("input_ids", "response_mask", "loss_mask", "rollout_logprobs")
#: Turn-level lists: each has one entry per turn (the length of turn_starts).
TURN_FIELDS: tuple[str, ...] = (
    "turn_starts",
    "turn_ends",
    "turn_rewards",
    "turn_actions",
    "turn_format_ok",
    "turn_think",
    "turn_responses",
    "turn_observations",
)


class TrajectoryStatus(StrEnum):
    """Why an episode ended."""

    TERMINATED = "terminated"  # the game ended (goal reached, fell in a hole, bandit pulled)
    MAX_TURNS = "max_turns"  # the agent used all its turns
    MAX_ACTIONS = "max_actions"  # the game truncated: max actions per episode reached
    CONTEXT = "context"  # the next turn would not fit in the model's context: stopped cleanly


@dataclass(frozen=True)
class Trajectory:
    """One episode. All token-level lists have the same length T."""

    # --- identity -----------------------------------------------------------------------------
    traj_id: str  # unique within a batch
    env_name: str  # registry name of the game, e.g. "frozen_lake"
    seed: int  # env seed: fixes the initial state (same seed -> same task on every machine)
    group_id: int  # trajectories with the same group_id share the initial state (GRPO / filter group)
    # --- provenance (freshness) -----------------------------------------------------------------
    policy_version: int  # version of the policy that sampled it (checkpoint step)
    weights_fingerprint: str  # sha256 of the weight file of that policy version
    # --- tokens: each (T,) ----------------------------------------------------------------------
    input_ids: list[int]  # prompt + per turn: sampled response ids then fed observation ids
    response_mask: list[int]  # 1 = token the policy sampled; 0 = prompt / observation token
    loss_mask: list[int]  # 1 = token trained on. == response_mask unless observation tokens are
    #                       also trained on (the paper's original runs); 0 on every prompt token
    rollout_logprobs: list[float]  # log p(token) under the sampling policy where response_mask=1, else 0
    # --- turns: each (n_turns,) -----------------------------------------------------------------
    turn_starts: list[int]  # index in input_ids of the turn's first sampled token
    turn_ends: list[int]  # index one past the turn's last sampled token
    turn_rewards: list[float]  # env rewards of the turn's actions + format penalty of the turn
    turn_actions: list[list[str]]  # canonical action names executed this turn (may be empty)
    turn_format_ok: list[bool]  # the answer parsed and every action was valid
    turn_think: list[str]  # text inside <think>..</think> ("" if none); reports and metrics only
    turn_responses: list[str]  # decoded response; reports, the actions named (turn_q); never re-tokenised
    turn_observations: list[str]  # the board text shown before the turn; reports only
    # --- outcome ----------------------------------------------------------------------------------
    reward: float  # trajectory reward = sum(turn_rewards)
    success: bool  # the game reported success
    status: str  # a TrajectoryStatus value
    prompt_length: int  # number of tokens of the initial prompt (input_ids[:prompt_length])

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_turns(self) -> int:
        return len(self.turn_starts)

    @property
    def response_length(self) -> int:
        """Number of policy-sampled tokens."""
        return sum(self.response_mask)

    def check(self) -> None:
        """Raise ValueError naming the field if the internal invariants do not hold."""
        t = len(self.input_ids)
        for name in TOKEN_FIELDS[1:]:
            if len(getattr(self, name)) != t:
                raise ValueError(
                    f"trajectory {self.traj_id}: len({name})={len(getattr(self, name))} != len(input_ids)={t}"
                )
        n = len(self.turn_starts)
        for name in TURN_FIELDS[1:]:
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.traj_id}: len({name})={len(getattr(self, name))} != num turns {n}")
        if not 0 <= self.prompt_length <= t:
            raise ValueError(f"trajectory {self.traj_id}: prompt_length={self.prompt_length} outside [0, {t}]")
        if any(self.loss_mask[: self.prompt_length]):
            raise ValueError(f"trajectory {self.traj_id}: loss_mask covers prompt tokens")
        for s, e in zip(self.turn_starts, self.turn_ends, strict=True):
            if not self.prompt_length <= s <= e <= t:
                raise ValueError(f"trajectory {self.traj_id}: turn span [{s}, {e}) outside [{self.prompt_length}, {t}]")
        if not math.isclose(self.reward, sum(self.turn_rewards), rel_tol=1e-6, abs_tol=1e-6):
            raise ValueError(f"trajectory {self.traj_id}: reward {self.reward} != sum(turn_rewards)")
        if self.status not in TrajectoryStatus._value2member_map_:
            raise ValueError(
                f"trajectory {self.traj_id}: status={self.status!r} not one of {[s.value for s in TrajectoryStatus]}"
            )


ARROW_SCHEMA = pa.schema(
    [
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("env_name", pa.string(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("weights_fingerprint", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("turn_starts", pa.list_(pa.int32()), nullable=False),
        pa.field("turn_ends", pa.list_(pa.int32()), nullable=False),
        pa.field("turn_rewards", pa.list_(pa.float32()), nullable=False),
        pa.field("turn_actions", pa.list_(pa.list_(pa.string())), nullable=False),
        pa.field("turn_format_ok", pa.list_(pa.bool_()), nullable=False),
        pa.field("turn_think", pa.list_(pa.string()), nullable=False),
        pa.field("turn_responses", pa.list_(pa.string()), nullable=False),
        pa.field("turn_observations", pa.list_(pa.string()), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("success", pa.bool_(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("prompt_length", pa.int32(), nullable=False),
    ],
    metadata={"ragen_schema_version": str(SCHEMA_VERSION)},
)

_FIELD_NAMES = [f.name for f in fields(Trajectory)]
if ARROW_SCHEMA.names != _FIELD_NAMES:  # a schema edit that forgot one side must fail at import, not on disk
    raise ImportError("Trajectory fields and ARROW_SCHEMA must list the same columns in the same order")


def to_table(trajectories: list[Trajectory]) -> pa.Table:
    """Trajectories -> Arrow table with ``ARROW_SCHEMA`` (log-probs become float32)."""
    # getattr, not dataclasses.asdict: asdict deep-copies every token list.
    columns = {name: [getattr(traj, name) for traj in trajectories] for name in _FIELD_NAMES}
    return pa.Table.from_pydict(columns, schema=ARROW_SCHEMA)


def from_table(table: pa.Table) -> list[Trajectory]:
    """Arrow table -> trajectories. Raises ValueError naming missing or unexpected columns."""
    missing = sorted(set(_FIELD_NAMES) - set(table.column_names))
    extra = sorted(set(table.column_names) - set(_FIELD_NAMES))
    if missing or extra:
        raise ValueError(
            f"trajectory table does not match schema v{SCHEMA_VERSION}: missing={missing} unexpected={extra}"
        )
    rows = table.select(_FIELD_NAMES).to_pylist()
    return [Trajectory(**row) for row in rows]
