"""Engine registry: lazy resolution by name or dotted path, clear errors."""

from __future__ import annotations

import sys

import pytest

from ragen_tasks.rollout.registry import ENGINES, make_engine, resolve_engine


def test_hf_resolves_to_the_engine_class() -> None:
    from ragen_tasks.rollout.hf_engine import HFEngine

    assert resolve_engine("hf") is HFEngine


def test_dotted_path_resolves_any_class() -> None:
    assert resolve_engine("collections:OrderedDict").__name__ == "OrderedDict"
    assert make_engine("collections:Counter", a=2)["a"] == 2


def test_vllm_is_not_imported_until_chosen() -> None:
    import ragen_tasks.rollout.registry  # noqa: F401

    assert "vllm" not in sys.modules
    assert ENGINES["vllm"].startswith("ragen_tasks.rollout.vllm_engine:")


def test_unknown_name_lists_the_known_names() -> None:
    with pytest.raises(ValueError) as err:
        resolve_engine("nope")
    for name in ("hf", "vllm", "openai", "scripted"):
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("path", "exc", "needle"),
    [
        ("no_such_module_xyz:Engine", ImportError, "no_such_module_xyz"),
        ("collections:NoSuchThing", ImportError, "NoSuchThing"),
        ("collections:", ValueError, "module:Class"),
        ("os.path:sep", TypeError, "not a class"),
    ],
)
def test_bad_dotted_paths_say_what_is_wrong(path: str, exc: type[Exception], needle: str) -> None:
    with pytest.raises(exc, match=needle):
        resolve_engine(path)
