"""Plug-in points: a sandbox backend or an agent harness chosen by name, or a user's own class by its path.

`make_backend(name)` (`swe_grpo.sandbox`) and `make_agent(name)` (`swe_grpo.agents`) take a name of their
registry (`BACKENDS`, `AGENTS`: name -> "module:Class") or a class of one's own as a dotted path,
`mypkg.mod:MyBackend` (or `mypkg.mod.MyBackend`), importable where the class is built (a rollout host, a Ray
node). `check_choice` tells, without importing anything, whether a name can be one (for configuration and
command-line checks); `load_object` imports a dotted path. Every refusal is a `ValueError` that names the
spec and what is wrong with it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})*"
_COLON_FORM = re.compile(rf"({_DOTTED}):({_DOTTED})")
_DOT_FORM = re.compile(rf"({_DOTTED})\.({_IDENTIFIER})")


def is_dotted_path(spec: str) -> bool:
    """Whether `spec` is written as a dotted path ("module:attr" or "module.attr"), well-formed or not."""
    return ":" in spec or "." in spec


def _split(spec: str, kind: str) -> tuple[str, str]:
    """(module, attribute path) of a dotted path; `ValueError` when it is malformed."""
    if match := _COLON_FORM.fullmatch(spec) or _DOT_FORM.fullmatch(spec):
        return match.group(1), match.group(2)
    raise ValueError(
        f"bad {kind} path {spec!r}: write it as 'package.module:Class' (or 'package.module.Class'), "
        "Python identifiers separated by dots"
    )


def load_object(spec: str, kind: str, *, base: type | None = None) -> type:
    """The class `spec` ("package.module:Class" or "package.module.Class") names, imported. `kind` names what
    it is for in errors ("sandbox backend", "agent"); with `base`, the class must be a subclass of it.
    Raises `ValueError` naming `spec` and what went wrong: bad syntax, module not found, module failing to
    import, attribute missing, not a class, not a subclass of `base`."""
    module_name, attribute = _split(spec, kind)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name != e.name and not module_name.startswith(f"{e.name}."):
            raise ValueError(f"{kind} {spec!r}: importing module {module_name!r} failed: {e}") from e
        raise ValueError(f"{kind} {spec!r}: no module named {module_name!r} (is it on sys.path?)") from e
    except Exception as e:
        raise ValueError(f"{kind} {spec!r}: importing module {module_name!r} failed: {e!r}") from e
    obj: object = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(obj, type):
        raise ValueError(f"{kind} {spec!r} is not a class but {type(obj).__name__} {obj!r}")
    if base is not None and not issubclass(obj, base):
        raise ValueError(f"{kind} {spec!r}: {obj.__qualname__} is not a subclass of {base.__qualname__}")
    return obj


def check_choice(name: str, registry: Mapping[str, str], kind: str) -> str:
    """`name` when it is one of `registry` or a well-formed dotted path (not imported); else `ValueError`:
    "unknown <kind> '<name>': choose one of ..., or give a class as 'package.module:Class'"."""
    if name in registry:
        return name
    if not is_dotted_path(name):
        raise ValueError(
            f"unknown {kind} {name!r}: choose one of {', '.join(registry)}, "
            "or give a class of your own as 'package.module:Class'"
        )
    _split(name, kind)
    return name


def load_choice(name: str, registry: Mapping[str, str], kind: str, *, base: type | None = None) -> type:
    """The class `name` stands for: the registry's entry, or a dotted path of one's own (`check_choice`,
    then `load_object`)."""
    return load_object(registry.get(check_choice(name, registry, kind), name), kind, base=base)
