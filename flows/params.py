"""Parameter types shared by the flows' signatures, for the Prefect UI's run form.

Prefect builds each deployment's parameter schema from the flow's signature (types, pydantic
``Field`` constraints, examples) and the docstring's ``Args:`` section (descriptions). The server
checks a run's parameters against that schema when the run is created, so a value outside an enum
or a bound is refused at once, in the form, instead of failing minutes later on a worker.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ragen_tasks.envs import ENV_NAMES
from ragen_tasks.presets import available_presets

#: A shipped preset, offered as a choice in the UI (the schema's ``enum``; the server refuses any
#: other name when a run is created). Called in-process (``ragen train``), the flow also takes the
#: path of a preset YAML file: pydantic checks only that it is a string, ``load_config`` the rest.
PresetChoice = Annotated[str, Field(min_length=1, json_schema_extra={"enum": available_presets()})]

#: A game name, offered as a choice in the UI (the server refuses any other when a run is created).
EnvChoice = Annotated[str, Field(json_schema_extra={"enum": list(ENV_NAMES)})]
