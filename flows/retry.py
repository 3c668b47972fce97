"""When a failed task attempt is worth retrying: every flow's ``retry_condition_fn`` comes from here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def retry_unless(*final: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """A task's ``retry_condition_fn``: retry a failed attempt unless its error is one of ``final``
    (bad input, a diverged update ...: a retry would meet it again and only delay its message).
    Prefect hands the condition a Failed state whose ``data`` is the attempt's exception."""

    def condition(task: Any, task_run: Any, state: Any) -> bool:
        return not isinstance(state.data, final)

    return condition
