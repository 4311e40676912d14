"""Config values checked against signatures and type hints, and built: the
``class_path`` / ``init_args`` objects of the ``ember`` command line (docs/cli.md).

Every ``class_path`` is imported and checked before any object is built: against the
parameter's type where it is a class, and where the argument has no type (untyped,
``Any`` or ``object``) against the few bases ember builds there (:func:`untyped_bases`),
so a config cannot make ember build an arbitrary class such as ``subprocess.Popen``.
An argument whose type holds data (``dict``, ``str``, ``list[int]``, ...) takes a
mapping as data, and a mapping with a ``class_path`` there is refused, naming the
argument.
"""
from __future__ import annotations

import inspect
import os
import re
import typing
from pathlib import Path, PurePath
from typing import Any

from ember.errors import UsageError


def _unknown(where: str, valid, what: str = "key") -> str:
    import difflib
    name = where.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{where}: unknown {what}{hint}; valid: {', '.join(valid) or '(none)'}"


# --------------------------------------------------------------------------- validation
_SCI_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_FLOAT = re.compile(r"[-+]?((\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|inf|infinity|nan)", re.IGNORECASE)
_DROP = object()


class ClassSpec(dict):
    """A checked ``{class_path, init_args}`` entry (made only by :func:`resolve_class`):
    the one kind of mapping :func:`instantiate` builds. ``cls`` is the checked class."""

    cls: type

    def __init__(self, cls: type, init_args: dict) -> None:
        super().__init__(class_path=f"{cls.__module__}.{cls.__qualname__}", init_args=init_args)
        self.cls = cls


def _type_name(tp) -> str:
    if tp is type(None) or tp is None:
        return "None"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "None")


def untyped_bases() -> tuple[type, ...]:
    """What a ``class_path`` may build where the argument has no type (or ``Any``):
    torch modules and datasets, ember callbacks, loggers, strategies and precisions.
    Annotate the argument with its class to build anything else."""
    import torch

    from ember.callbacks.base import Callback
    from ember.loggers import Logger
    from ember.precision import Precision
    from ember.strategies import Strategy
    return (torch.nn.Module, torch.utils.data.Dataset, Callback, Logger, Strategy, Precision) + _optional_bases()


def _optional_bases() -> tuple[type, ...]:
    """Classes of optional packages that an untyped argument may also build, once the
    package is imported (by the ``class_path`` that names it): ``peft.PeftConfig`` and its
    subclasses (``peft.LoraConfig``, ...), data classes that run no code when built (for
    ``TransformersModule(peft_config=...)``)."""
    import sys
    peft = sys.modules.get("peft")
    cls = getattr(peft, "PeftConfig", None) if peft is not None else None
    return (cls,) if isinstance(cls, type) else ()


def _short_name_modules(base) -> list[str]:
    if base is None or isinstance(base, tuple):
        return ["ember.callbacks", "ember.loggers", "ember.strategies"]
    parts = base.__module__.split(".")
    return [".".join(parts[:i]) for i in range(min(2, len(parts)), len(parts) + 1)]


def _allowed_packages(base) -> set[str]:
    """The top-level packages of the classes a ``class_path`` may build here (ember's and
    torch's where the argument has no type)."""
    bases = base if isinstance(base, tuple) else (base,) if base is not None else ()
    return {"ember", "torch"} | {b.__module__.split(".")[0] for b in bases}


def _check_importable(where: str, path: str, base=None) -> None:
    """Decide, before anything is imported, whether ``path``'s top-level module may be
    imported: importing runs its top-level code, so a config must not name just any module.

    - the packages of the classes the argument takes (ember, torch, the annotated class's
      package), and modules already imported, are imported;
    - a module of the standard library is refused (``this`` prints the Zen of Python,
      ``antigravity`` opens a browser): it cannot hold a subclass of ember's or torch's
      classes, and one of its own classes is built only where the argument is annotated
      with a class of that module's package;
    - an installed package, or the user's own module on ``sys.path`` (``PYTHONPATH``), is
      imported: it may hold the class;
    - the working directory is not searched for other imports: a module found only there
      is imported when the config names it (the user's own ``toy.ToyRegressor`` run from
      its folder), and only then is the working directory added to ``sys.path``, at its end
      (so that module's own imports of its neighbours work, and nothing installed is shadowed).
    """
    import importlib.machinery
    import importlib.util
    import sys
    top = path.split(".")[0]
    if top in sys.modules or top in _allowed_packages(base):
        return
    if top in getattr(sys, "stdlib_module_names", ()) or top in sys.builtin_module_names:
        raise UsageError(f"{where}: {path!r} names the standard-library module {top!r}, which holds no class ember "
                         "builds here; it is not imported (importing runs its code). Give the class's full path in "
                         "your own package, e.g. my_package.module.MyClass")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        return
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path and \
            importlib.machinery.PathFinder.find_spec(top, [cwd]) is not None:
        sys.path.append(cwd)       # the user's own module, named by the config: its folder is searched last


def _import_class(where: str, path: Any, base=None) -> type:
    import importlib
    if not isinstance(path, str) or not path:
        raise UsageError(f"{where}: expected a class path like my_package.module.MyClass, got {path!r}")
    if "." in path:
        candidates = [tuple(path.rsplit(".", 1))]
        _check_importable(where, path, base)
    else:
        candidates = [(m, path) for m in _short_name_modules(base)]
    for mod_name, name in candidates:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as err:
            if "." in path:
                raise UsageError(f"{where}: cannot import {path!r}: {err}")
            continue
        try:
            obj = getattr(module, name, None)
        except ImportError as err:      # a lazily imported attribute whose module failed
            raise UsageError(f"{where}: cannot import {path!r}: {err}")
        if obj is None and "." in path:
            raise UsageError(f"{where}: cannot import {path!r}: module {mod_name!r} has no "
                             f"attribute {name!r}")
        if obj is not None:
            if not inspect.isclass(obj):
                raise UsageError(f"{where}: {path!r} is not a class")
            return obj
    raise UsageError(f"{where}: class {path!r} not found in {', '.join(m for m, _ in candidates)}; "
                     "give its full path, e.g. my_package.module.MyClass")


def resolve_class(where: str, value: Any, base=None, fixed=None) -> dict:
    """Check a ``{class_path, init_args}`` entry; returns it with init_args complete."""
    if value is None and fixed is None:
        raise UsageError(f"{where}: missing; give {where}: {{class_path: my_package.module.MyClass, "
                         "init_args: {...}}")
    value = {} if value is None else value
    if isinstance(value, str):
        value = {"class_path": value}
    if not isinstance(value, dict):
        raise UsageError(f"{where}: expected a mapping with class_path and init_args, got {value!r}")
    if fixed is not None and not {"class_path", "init_args"} & set(value):
        value = {"init_args": value}       # a fixed class: init arguments given directly
    for key in value:
        if key not in ("class_path", "init_args"):
            raise UsageError(_unknown(f"{where}.{key}", ("class_path", "init_args")))
    if value.get("class_path") is None:
        if fixed is None:
            raise UsageError(f"{where}.class_path: missing; name the class, e.g. "
                             "class_path: my_package.module.MyClass")
        cls = fixed
    else:
        cls = _import_class(f"{where}.class_path", value["class_path"], base)
    if isinstance(base, tuple):   # the class path's own import may have brought an optional base
        base = tuple(dict.fromkeys(base + _optional_bases()))
    if isinstance(base, tuple) and not issubclass(cls, base):
        raise UsageError(f"{where}.class_path: {value.get('class_path')!r} is given for an argument without a "
                         "type, where ember builds only subclasses of "
                         f"{', '.join(b.__name__ for b in base)}; annotate the argument with the class it takes "
                         "(its type is then checked) to build another class")
    if base is not None and not isinstance(base, tuple) and not issubclass(cls, base):
        raise UsageError(f"{where}.class_path: {value.get('class_path')!r} is not a subclass of "
                         f"{base.__name__}")
    init = value.get("init_args") or {}
    if not isinstance(init, dict):
        raise UsageError(f"{where}.init_args: expected a mapping, got {init!r}")
    return ClassSpec(cls, check_kwargs(f"{where}.init_args", cls, init))


def check_kwargs(where: str, target, kwargs: dict, fill_defaults: bool = True) -> dict:
    """Check ``kwargs`` against the signature and type hints of ``target``."""
    sig = inspect.signature(target)
    fn = target.__init__ if inspect.isclass(target) else target
    try:
        hints = typing.get_type_hints(fn)
    except Exception:      # some forward reference does not resolve: check the others
        hints, scope = {}, getattr(fn, "__globals__", {})
        for name, ann in getattr(fn, "__annotations__", {}).items():
            try:
                hints[name] = eval(ann, scope) if isinstance(ann, str) else ann  # noqa: S307
            except Exception:
                pass
    P = inspect.Parameter
    params = [p for p in sig.parameters.values()
              if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p.name != "self"]
    var_kw = any(p.kind == P.VAR_KEYWORD for p in sig.parameters.values())
    names = [p.name for p in params]
    for key in kwargs:
        if key not in names and not var_kw:
            raise UsageError(_unknown(f"{where}.{key}", names))
    out: dict[str, Any] = {}
    for p in params:
        tp = hints.get(p.name, p.annotation if not isinstance(p.annotation, str) else Any)
        if tp is P.empty:   # unannotated: a numeric default tells the type
            tp = {float: float, int: typing.Union[int, float]}.get(type(p.default), Any)
        if p.name in kwargs:
            out[p.name] = _check(f"{where}.{p.name}", kwargs[p.name], tp)
        elif p.default is P.empty:
            raise UsageError(f"{where}: missing required argument {p.name!r} of "
                             f"{getattr(target, '__qualname__', target)}")
        elif fill_defaults:
            out[p.name] = p.default
    for key in kwargs:
        if key not in names:
            out[key] = _untyped(f"{where}.{key}", kwargs[key])
    return out


def _check(where: str, value: Any, tp) -> Any:
    ok, out = _match(where, value, tp)
    if not ok:
        raise UsageError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    return out


def _is_class_mapping(value: Any) -> bool:
    return isinstance(value, dict) and "class_path" in value


#: types whose values are data: a ``class_path`` mapping given for them is refused
_DATA_TYPES = (bool, int, float, complex, str, bytes, bytearray, dict, list, tuple, set, frozenset,
               type(None), os.PathLike, PurePath)


def _class_arms(tp) -> "list | None":
    """The classes a ``class_path`` given for an argument of type ``tp`` may build:
    ``None`` when the type sets no class (untyped, ``Any``, ``object``, ``Callable``...,
    where :func:`untyped_bases` apply), ``[]`` when the type holds data only."""
    import collections.abc as abc
    import enum
    import types
    if tp is Any or tp is object or isinstance(tp, typing.TypeVar) or tp is inspect.Parameter.empty:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _class_arms(args[0])
    if origin in (typing.Union, types.UnionType):
        arms: list = []
        untyped = False
        for arm in args:
            got = _class_arms(arm)
            if got is None:
                untyped = True
            else:
                arms += [a for a in got if a not in arms]
        return None if untyped and not arms else ([*arms, None] if untyped else arms)
    if origin is typing.Literal or origin in (list, set, frozenset, tuple, dict, abc.Sequence, abc.MutableSequence,
                                              abc.Iterable, abc.Collection, abc.Mapping, abc.MutableMapping):
        return []
    if origin is not None or not isinstance(tp, type):   # Callable, type[...], protocols...
        return None
    if tp in _DATA_TYPES or issubclass(tp, (PurePath, enum.Enum)) or tp is os.PathLike:
        return []
    return [tp]


def _resolve_for(where: str, value: dict, tp) -> "ClassSpec":
    """A ``class_path`` mapping given for an argument of type ``tp``: checked against the
    class(es) of the type, or refused where the type holds data."""
    arms = _class_arms(tp)
    if arms is None:
        return resolve_class(where, value, base=untyped_bases())
    if not arms:
        raise UsageError(f"{where}: a mapping with class_path ({value.get('class_path')!r}) is given for an "
                         f"argument of type {_type_name(tp)}, which holds data, not an object to build; "
                         "ember builds a class_path only where the argument's type is a class the path "
                         "subclasses (and for the trainer's callbacks, logger, strategy). Give plain values "
                         "here, or annotate the argument with the class it takes")
    classes = [a for a in arms if a is not None]
    if len(arms) == 1:
        return resolve_class(where, value, base=arms[0])
    cls = _import_class(f"{where}.class_path", value.get("class_path"), classes[0])
    for arm in classes:
        if issubclass(cls, arm):
            return resolve_class(where, value, base=arm)
    if None in arms:       # the type also has an untyped arm
        return resolve_class(where, value, base=untyped_bases())
    raise UsageError(f"{where}.class_path: {value.get('class_path')!r} is not a subclass of "
                     f"{' or '.join(a.__name__ for a in classes)}")


def _untyped(where: str, value: Any) -> Any:
    if isinstance(value, dict) and "class_path" in value:
        return resolve_class(where, value, base=untyped_bases())
    if isinstance(value, dict):
        return {k: _untyped(f"{where}.{k}", v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untyped(f"{where}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, str) and _SCI_FLOAT.fullmatch(value.strip()):
        return float(value)      # YAML 1.1 reads 1e-3 as a string
    return value


def _match(where: str, value: Any, tp) -> tuple[bool, Any]:
    import collections.abc as abc
    import enum
    import types
    if tp is Any or tp is object or isinstance(tp, typing.TypeVar):
        return True, _untyped(where, value)
    if _is_class_mapping(value):      # built only where the type is a class it subclasses
        return True, _resolve_for(where, value, tp)
    if tp is None or tp is type(None):
        return value is None, value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _match(where, value, args[0])
    if origin in (typing.Union, types.UnionType):
        # the value's own type first (4 stays an int in float | int); str last ('1e-3' -> float)
        for arm in sorted(args, key=lambda a: (a is str, a is not type(value))):
            ok, out = _match(where, value, arm)
            if ok:
                return True, out
        return False, value
    if origin is typing.Literal:
        return value in args, value
    if origin in (list, set, frozenset, abc.Sequence, abc.MutableSequence, abc.Iterable,
                  abc.Collection) or tp in (list, set, frozenset):
        if not isinstance(value, list):
            return False, value
        items = [_check(f"{where}[{i}]", v, args[0] if args else Any) for i, v in enumerate(value)]
        return True, (set(items) if (origin or tp) in (set, frozenset) else items)
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)):
            return False, value
        kinds = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if args and len(kinds) != len(value):
            return False, value
        kinds = kinds or [Any] * len(value)
        return True, tuple(_check(f"{where}[{i}]", v, t) for i, (v, t) in enumerate(zip(value, kinds)))
    if origin in (dict, abc.Mapping, abc.MutableMapping) or tp is dict:
        if not isinstance(value, dict):
            return False, value
        vt = args[1] if len(args) == 2 else Any
        return True, {k: _check(f"{where}.{k}", v, vt) for k, v in value.items()}
    if origin is not None or not isinstance(tp, type):   # Callable, type[...], protocols...
        return True, _untyped(where, value)
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if isinstance(value, tp):
        return True, value
    if isinstance(value, str) and (tp is os.PathLike or issubclass(tp, PurePath)):
        return True, Path(value) if tp is os.PathLike else tp(value)
    if issubclass(tp, enum.Enum):
        for member in tp:
            if value in (member.value, member.name):
                return True, member
    return False, value


def to_yaml_safe(value: Any) -> Any:
    """The config as plain YAML data (values YAML cannot hold are left out)."""
    import enum
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return to_yaml_safe(value.value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [to_yaml_safe(v) for v in value]
        return [v for v in items if v is not _DROP]
    if isinstance(value, dict):
        items = {str(k): to_yaml_safe(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _DROP}
    return _DROP


def instantiate(value: Any) -> Any:
    """Build the objects of a resolved config: each :class:`ClassSpec` (a ``class_path``
    entry that :func:`resolve_class` checked) -> instance, innermost first. Any other
    mapping is data, a ``class_path`` key in it included: it is never built."""
    if isinstance(value, ClassSpec):
        return value.cls(**{k: instantiate(v) for k, v in (value.get("init_args") or {}).items()})
    if isinstance(value, dict):
        return {k: instantiate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [instantiate(v) for v in value]
    if isinstance(value, tuple):
        return tuple(instantiate(v) for v in value)
    return value
