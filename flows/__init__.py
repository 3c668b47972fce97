"""Prefect flows over the ``ragen_tasks`` library: orchestration only, no RL math.

Importing this package switches Prefect's anonymous usage analytics off (unless the user set the
variable): a training node must only talk to the endpoints it is configured for.
"""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
