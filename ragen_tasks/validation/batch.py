"""Great Expectations suite for a trajectory batch, run before every update (design section 6).

GX checks a small flat frame with ONE ROW PER TRAJECTORY whose columns are scalars precomputed
from the Arrow table with vectorised pyarrow/numpy (lengths, mask sums, finiteness flags), so GX
walks one row per trajectory, never the tokens. The suite (built in code, ephemeral context, pandas data source) checks:

- schema: every derived column is present (a source column that is missing or has the wrong
  Arrow type removes the columns derived from it), and the schema version is ours;
- identity: ``traj_id`` non-null and unique;
- row invariants, one ``row_problems`` column that must be empty (``""``) on every row, else it
  names what is wrong (comma-separated, see ``ROW_PROBLEMS``): the trajectory or a turn reward is
  not finite, token/turn lists differ in length, a mask is not 0/1 or the loss covers prompt
  tokens, a rollout log-prob is not finite. One expectation instead of four: GX's cost grows with the number of
  expectations whatever the data, and these four were each a precomputed flag checked for ``True``;
- reward within ``[reward_min, reward_max]``; at least one policy token under the loss
  (``sum(loss_mask * response_mask) >= 1``);
- lengths: ``1 <= tokens <= max_tokens`` and ``1 <= turns <= max_turns``;
- versions: every trajectory's ``policy_version`` / ``weights_fingerprint`` equal the manifest's
  (suite parameters, so the suite is built once per set of limits, not once per policy version).

:func:`validate_stored_batch` reads a committed batch; if it fails, the batch is moved to the
quarantine prefix with the validation result JSON beside it and :class:`BatchValidationError`
names the failed expectations. A failing batch is never returned, so it is never trained on.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ragen_tasks.data.manifest import CorruptObjectError
from ragen_tasks.data.trajectory import (
    ARROW_SCHEMA,
    SCHEMA_VERSION,
    TOKEN_FIELDS,
    TURN_FIELDS,
    Trajectory,
    TrajectoryStatus,
    from_table,
)

if TYPE_CHECKING:
    from ragen_tasks.data.manifest import Manifest
    from ragen_tasks.data.store import Store

log = logging.getLogger(__name__)

SUITE_NAME = "ragen_trajectory_batch"


@dataclass(frozen=True)
class BatchLimits:
    """Bounds a batch must satisfy (from the config: agent limits and the store's reward bounds)."""

    reward_min: float
    reward_max: float
    max_tokens: int  # e.g. AgentConfig.max_context_tokens
    max_turns: int  # e.g. AgentConfig.max_turns

    def __post_init__(self) -> None:
        if not (np.isfinite(self.reward_min) and np.isfinite(self.reward_max) and self.reward_min <= self.reward_max):
            raise ValueError(
                f"BatchLimits: reward bounds [{self.reward_min}, {self.reward_max}] must be finite and ordered"
            )
        if self.max_tokens < 1 or self.max_turns < 1:
            raise ValueError(f"BatchLimits: max_tokens={self.max_tokens} and max_turns={self.max_turns} must be >= 1")


class BatchValidationError(ValueError):
    """A batch failed validation; ``failed`` names the expectations, ``quarantine_uri`` where it went."""

    def __init__(self, message: str, failed: list[str], quarantine_uri: str | None = None) -> None:
        super().__init__(message)
        self.failed = failed
        self.quarantine_uri = quarantine_uri


@dataclass(frozen=True)
class ValidationOutcome:
    success: bool
    failed: list[str]  # "expect_...(column)" of every failed expectation
    result: dict[str, Any]  # summary; on failure also the GX result JSON ("gx"), stored beside a quarantined batch


# Derived column -> source columns of ARROW_SCHEMA it is computed from.
_DERIVED: dict[str, tuple[str, ...]] = {
    "traj_id": ("traj_id",),
    "reward": ("reward",),
    "policy_version": ("policy_version",),
    "weights_fingerprint": ("weights_fingerprint",),
    "status": ("status",),
    "num_tokens": ("input_ids",),
    "num_turns": ("turn_starts",),
    "row_problems": ("reward", "prompt_length", *TOKEN_FIELDS, *TURN_FIELDS),
    "policy_loss_tokens": ("reward", "prompt_length", *TOKEN_FIELDS, *TURN_FIELDS),  # computed with row_problems
    "schema_version": (),
}
FRAME_COLUMNS: tuple[str, ...] = tuple(_DERIVED)

#: What ``row_problems`` may name (a row lists every one that applies, comma-separated).
ROW_PROBLEMS: dict[str, str] = {
    "reward_not_finite": "the trajectory reward or a turn reward is NaN or infinite",
    "lists_misaligned": "the token lists (or the turn lists) of the trajectory differ in length",
    "masks_malformed": "a response/loss mask value is not 0/1, or the loss covers prompt tokens",
    "logprobs_not_finite": "a rollout log-prob is NaN or infinite",
}


def schema_problems(table: pa.Table) -> list[str]:
    """Columns of ``ARROW_SCHEMA`` that are missing or typed differently in ``table``."""
    problems = []
    for expected in ARROW_SCHEMA:
        if expected.name not in table.column_names:
            problems.append(f"{expected.name}: missing")
        elif not table.schema.field(expected.name).type.equals(expected.type):
            problems.append(f"{expected.name}: type {table.schema.field(expected.name).type} != {expected.type}")
    extra = sorted(set(table.column_names) - set(ARROW_SCHEMA.names))
    problems += [f"{name}: unexpected column" for name in extra]
    return problems


def _per_row_sum(col: pa.ChunkedArray, values: np.ndarray, n: int) -> np.ndarray:
    """Sum ``values`` (aligned with ``pc.list_flatten(col)``) per list row. -> (n,)"""
    parents = pc.list_parent_indices(col).to_numpy()  # (L,) row of each flattened element
    return np.bincount(parents, weights=values, minlength=n)


def batch_frame(table: pa.Table) -> pd.DataFrame:
    """One row per trajectory, scalar columns only (see ``_DERIVED``); unknown sources are skipped."""
    n = table.num_rows
    bad = {p.split(":")[0] for p in schema_problems(table)}
    ok = {name for name in ARROW_SCHEMA.names if name not in bad}
    cols: dict[str, Any] = {}

    def has(derived: str) -> bool:
        return all(src in ok for src in _DERIVED[derived])

    for name in ("traj_id", "reward", "policy_version", "weights_fingerprint", "status"):
        if has(name):
            cols[name] = table.column(name).to_numpy(zero_copy_only=False)
    if has("num_tokens"):
        cols["num_tokens"] = pc.list_value_length(table.column("input_ids")).to_numpy()  # (n,)
    if has("num_turns"):
        cols["num_turns"] = pc.list_value_length(table.column("turn_starts")).to_numpy()  # (n,)
    if has("row_problems"):  # its sources include policy_loss_tokens' (the masks)
        cols["row_problems"], cols["policy_loss_tokens"] = _row_checks(table)
    meta = table.schema.metadata or {}
    cols["schema_version"] = np.full(n, int(meta.get(b"ragen_schema_version", b"-1")), dtype=np.int64)
    return pd.DataFrame(cols)


def _lists_aligned(table: pa.Table) -> np.ndarray:
    """(n,) bool: every token list as long as ``input_ids`` and every turn list as ``turn_starts``
    (the invariant of ``Trajectory.check``, vectorised over the table's list columns)."""
    aligned = np.ones(table.num_rows, dtype=bool)
    for group in (TOKEN_FIELDS, TURN_FIELDS):
        lengths = pc.list_value_length(table.column(group[0])).to_numpy()  # (n,) per trajectory
        for name in group[1:]:
            aligned &= pc.list_value_length(table.column(name)).to_numpy() == lengths
    return aligned


def _not_finite_per_row(col: pa.ChunkedArray, n: int) -> np.ndarray:
    """(n,) bool: some element of the row's float list is NaN or infinite."""
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False)  # (sum of lengths,)
    return _per_row_sum(col, (~np.isfinite(values)).astype(np.float64), n) > 0


def _mask_checks(table: pa.Table, rows_ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, over the rows whose lists are aligned (``rows_ok``; the others are reported as
    ``lists_misaligned`` and get ``False`` / 0 here): (n,) bool ``malformed`` (a mask value outside
    {0, 1}, or a loss on a prompt token) and (n,) int64 ``policy_loss_tokens`` (tokens with
    ``loss_mask * response_mask`` = 1)."""
    n = table.num_rows
    sub = table.filter(pa.array(rows_ok)) if not rows_ok.all() else table
    # Flattened masks over all tokens of those rows: (L,), L = sum of T. 1 = policy-sampled / trained-on token.
    resp = pc.list_flatten(sub.column("response_mask")).to_numpy(zero_copy_only=False).astype(np.int64)  # (L,)
    loss = pc.list_flatten(sub.column("loss_mask")).to_numpy(zero_copy_only=False).astype(np.int64)  # (L,)
    parents = pc.list_parent_indices(sub.column("loss_mask")).to_numpy()  # (L,) row of each token
    lengths = pc.list_value_length(sub.column("loss_mask")).to_numpy()  # (n_ok,)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # (n_ok,)
    pos = np.arange(len(loss)) - starts[parents]  # (L,) token position inside its trajectory
    prompt_len = sub.column("prompt_length").to_numpy()[parents]  # (L,)
    bad_tok = ((resp != 0) & (resp != 1)) | ((loss != 0) & (loss != 1)) | ((loss != 0) & (pos < prompt_len))
    malformed = np.zeros(n, dtype=bool)
    malformed[rows_ok] = np.bincount(parents, weights=bad_tok.astype(np.float64), minlength=sub.num_rows) > 0
    policy_loss_tokens = np.zeros(n, dtype=np.int64)
    policy_loss_tokens[rows_ok] = np.bincount(parents, weights=(loss * resp).astype(np.float64), minlength=sub.num_rows)
    return malformed, policy_loss_tokens


def _row_checks(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(n,) object array of str ``row_problems`` (the ``ROW_PROBLEMS`` names that apply to each
    row, comma-separated, "" if none) and (n,) int64 ``policy_loss_tokens``."""
    n = table.num_rows
    aligned = _lists_aligned(table)
    malformed, policy_loss_tokens = _mask_checks(table, aligned)
    flags = {
        "reward_not_finite": ~np.isfinite(table.column("reward").to_numpy())
        | _not_finite_per_row(table.column("turn_rewards"), n),
        "lists_misaligned": ~aligned,
        "masks_malformed": malformed,
        "logprobs_not_finite": _not_finite_per_row(table.column("rollout_logprobs"), n),
    }
    problems = np.full(n, "", dtype=object)
    for row in np.flatnonzero(np.logical_or.reduce(list(flags.values()))):
        problems[row] = ",".join(name for name, flag in flags.items() if flag[row])
    return problems, policy_loss_tokens


@functools.lru_cache(maxsize=8)
def build_suite(limits: BatchLimits) -> Any:
    """The expectation suite, in code (cached per limits). A ``great_expectations.ExpectationSuite``
    whose version checks take the manifest's values as suite parameters (``suite_parameters``)."""
    import great_expectations as gx

    _batch_definition()  # GX needs an active context before a suite can hold expectations

    gxe: Any = gx.expectations  # classes are re-exported untyped by GX
    suite = gx.ExpectationSuite(name=SUITE_NAME)
    for e in (
        gxe.ExpectTableColumnsToMatchSet(column_set=list(FRAME_COLUMNS), exact_match=True),
        gxe.ExpectColumnValuesToBeInSet(column="schema_version", value_set=[SCHEMA_VERSION]),
        gxe.ExpectColumnValuesToNotBeNull(column="traj_id"),
        gxe.ExpectColumnValuesToBeUnique(column="traj_id"),
        gxe.ExpectColumnValuesToBeInSet(column="row_problems", value_set=[""]),
        gxe.ExpectColumnValuesToBeBetween(column="reward", min_value=limits.reward_min, max_value=limits.reward_max),
        gxe.ExpectColumnValuesToBeBetween(column="policy_loss_tokens", min_value=1),
        gxe.ExpectColumnValuesToBeBetween(column="num_tokens", min_value=1, max_value=limits.max_tokens),
        gxe.ExpectColumnValuesToBeBetween(column="num_turns", min_value=1, max_value=limits.max_turns),
        gxe.ExpectColumnValuesToBeInSet(column="policy_version", value_set={"$PARAMETER": "policy_versions"}),
        gxe.ExpectColumnValuesToBeInSet(column="weights_fingerprint", value_set={"$PARAMETER": "fingerprints"}),
        gxe.ExpectColumnValuesToBeInSet(column="status", value_set=[s.value for s in TrajectoryStatus]),
    ):
        suite.add_expectation(e)
    return suite


def suite_parameters(policy_version: int, weights_fingerprint: str) -> dict[str, Any]:
    """The values the suite's ``$PARAMETER`` placeholders take: the manifest's version and fingerprint."""
    return {"policy_versions": [policy_version], "fingerprints": [weights_fingerprint]}


@functools.lru_cache(maxsize=1)
def _batch_definition() -> Any:
    """One ephemeral GX context with a pandas data source (created once per process)."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    asset = context.data_sources.add_pandas("ragen").add_dataframe_asset("trajectory_batch")
    return asset.add_batch_definition_whole_dataframe("whole_batch")


def expectation_name(config: Any, frame: pd.DataFrame | None = None) -> str:
    """``type(column)``; for ``row_problems`` also the problems found, e.g.
    ``expect_column_values_to_be_in_set(row_problems: masks_malformed)``."""
    column = config.kwargs.get("column")
    if not column:
        return str(config.type)
    if column == "row_problems" and frame is not None and column in frame:
        found = sorted({p for row in frame[column] if row for p in str(row).split(",")})
        return f"{config.type}({column}: {', '.join(found)})"
    return f"{config.type}({column})"


def validate_table(
    table: pa.Table, *, limits: BatchLimits, policy_version: int, weights_fingerprint: str
) -> ValidationOutcome:
    """Run the suite on a batch table; no I/O. ``policy_version``/fingerprint: the manifest's."""
    frame = batch_frame(table)
    batch = _batch_definition().get_batch(batch_parameters={"dataframe": frame})
    suite = build_suite(limits)
    parameters = suite_parameters(policy_version, weights_fingerprint)
    # Pass/fail only on the hot path (cheaper); a failing batch is validated again with the
    # observed and unexpected values, which the quarantine record keeps.
    result = batch.validate(suite, result_format="BOOLEAN_ONLY", expectation_parameters=parameters)
    if not result.success:
        result = batch.validate(suite, result_format="BASIC", expectation_parameters=parameters)
    failed = [expectation_name(r.expectation_config, frame) for r in result.results if not r.success]
    as_json: dict[str, Any] = {
        "success": bool(result.success),
        "failed": failed,
        "num_rows": table.num_rows,
        "schema_problems": schema_problems(table),
    }
    if not result.success:  # the full GX result (observed / unexpected values) only when needed
        as_json["gx"] = result.to_json_dict()
    return ValidationOutcome(success=bool(result.success), failed=failed, result=as_json)


def read_or_quarantine(
    store: Store, run_id: str, iteration: int, stage: str, name: str = "trajectories"
) -> tuple[pa.Table, Manifest]:
    """The committed batch as a table; if it cannot be read back, quarantine it and raise
    BatchValidationError saying that a rerun re-produces it."""
    try:
        return store.read_table(run_id, iteration, stage, name)
    except CorruptObjectError as exc:
        where = store.quarantine(run_id, iteration, stage, name, {"read_error": str(exc)})
        raise BatchValidationError(
            f"batch {store.uri(run_id, iteration, stage)} could not be read ({exc}). It was moved to {where} and "
            "will not be trained on; run the same command again to produce it again.",
            failed=["readable"],
            quarantine_uri=where,
        ) from exc


def validate_stored_batch(
    store: Store, run_id: str, iteration: int, stage: str, *, limits: BatchLimits, name: str = "trajectories"
) -> tuple[list[Trajectory], Manifest]:
    """Validate a committed batch; on failure quarantine it and raise BatchValidationError. A batch
    that cannot be read back (changed after commit, or not Parquet) is quarantined the same way, so
    a rerun of the stage that produced it produces it again instead of failing on it forever."""
    table, manifest = read_or_quarantine(store, run_id, iteration, stage, name)
    outcome = validate_table(
        table, limits=limits, policy_version=manifest.policy_version, weights_fingerprint=manifest.weights_fingerprint
    )
    if not outcome.success:
        where = store.quarantine(run_id, iteration, stage, name, outcome.result)
        problems = (
            f"; schema problems: {outcome.result['schema_problems']}" if outcome.result["schema_problems"] else ""
        )
        raise BatchValidationError(
            f"batch {store.uri(run_id, iteration, stage)} failed validation: {', '.join(outcome.failed)}{problems}. "
            f"It was moved to {where} (validation result beside it) and will not be trained on.",
            failed=outcome.failed,
            quarantine_uri=where,
        )
    return from_table(table), manifest
