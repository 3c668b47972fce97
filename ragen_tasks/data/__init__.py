"""The data plane: the trajectory schema, the store, manifests and freshness."""

from ragen_tasks.data.trajectory import SCHEMA_VERSION, Trajectory, TrajectoryStatus

__all__ = ["SCHEMA_VERSION", "Trajectory", "TrajectoryStatus"]
