"""Scripts written against 0.1 keep working until 0.3: every module path of 0.1 still imports (a moved
one with a DeprecationWarning, as the very module at its new path), and every public name a 0.1 module
defined is still there. `public_names_0_1.json` is the 0.1 surface, read from the code at 05711ed."""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from pathlib import Path

import pytest

import swe_grpo
from swe_grpo._compat import MOVED, MOVED_NAMES

PUBLIC_0_1: dict[str, list[str]] = json.loads((Path(__file__).with_name("public_names_0_1.json")).read_text())


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_imports_as_its_new_self_with_a_warning(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.modules.pop(old, None)  # imported before by another test: import it afresh
        module = importlib.import_module(old)
    assert module is new
    assert any(issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message) for w in caught)


@pytest.mark.parametrize("module", sorted(PUBLIC_0_1))
def test_every_public_name_of_0_1_is_still_there(module: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        imported = importlib.import_module(module)
        missing = [name for name in PUBLIC_0_1[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lost {missing}"


def test_moved_names_warn_and_resolve() -> None:
    for module, names in MOVED_NAMES.items():
        for name, new in names.items():
            with pytest.warns(DeprecationWarning, match=new):
                value = getattr(importlib.import_module(module), name)
            assert value is getattr(importlib.import_module(new), name)


def test_the_package_offers_every_name_it_lists() -> None:
    assert [name for name in swe_grpo.__all__ if getattr(swe_grpo, name, None) is None] == []
