"""Great Expectations validation of trajectory batches (run before every update)."""

from ragen_tasks.validation.batch import (
    BatchLimits,
    BatchValidationError,
    ValidationOutcome,
    validate_stored_batch,
    validate_table,
)

__all__ = ["BatchLimits", "BatchValidationError", "ValidationOutcome", "validate_stored_batch", "validate_table"]
