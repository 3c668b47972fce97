"""Crash injection inside the update's ranks, for the multi-rank resume test.

Python imports ``sitecustomize`` at start-up from the path, so every process started with this folder
on PYTHONPATH (the ranks torchrun starts) runs this. ``RAGEN_TEST_KILL_IN_SAVE=STEP:RANK`` makes
rank RANK SIGKILL itself right after it wrote its first file of checkpoint STEP (for a sharded
optimizer: its own part), before the commit. Any other process (torchrun itself, no RANK) is untouched.
"""

import os

_spec = os.environ.get("RAGEN_TEST_KILL_IN_SAVE")
if _spec and "RANK" in os.environ:
    _step, _rank = (int(x) for x in _spec.split(":"))
    if int(os.environ["RANK"]) == _rank:
        import signal
        from typing import Any

        import torch

        from ragen_tasks.training import checkpoint as _ckpt

        _real_save_checkpoint = _ckpt.save_checkpoint

        def _save_checkpoint(root: Any, step: int, **kwargs: Any) -> Any:
            if step == _step:
                real_torch_save = torch.save

                def save_then_die(obj: Any, f: Any, *a: Any, **kw: Any) -> None:
                    real_torch_save(obj, f, *a, **kw)
                    os.kill(os.getpid(), signal.SIGKILL)

                torch.save = save_then_die  # checkpoint.py calls torch.save through the torch module
            return _real_save_checkpoint(root, step, **kwargs)

        _ckpt.save_checkpoint = _save_checkpoint  # the pipeline saves through the checkpoint module
