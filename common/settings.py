"""Settings declared once: a frozen dataclass field per knob, carrying its
default, help text and flag name; the command-line flags and their
``RADIXSERVE_*`` environment defaults are generated from it.

    @dataclass(frozen=True)
    class Limits:
        max_n: int = setting(16, "most samples per request (n)")

    parser = argparse.ArgumentParser()
    add_flags(parser, Limits, os.environ, "RADIXSERVE_")   # --max-n, RADIXSERVE_MAX_N
    limits = build(Limits, parser.parse_args())

A field is a flag unless declared with ``flag=None``; a field whose default
is a dataclass declared with ``section(...)`` nests: its fields become flags
of their own (an argument group), and ``build`` makes the nested object.
Values from the environment go through the same parser as the flag's, and
booleans through ``parse_bool`` wherever they come from. A flag renamed or
folded into another stays accepted through ``deprecated`` with a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

_KEY = "radixserve.setting"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def parse_bool(text: str | bool) -> bool:
    """The one boolean rule: 1/true/yes/on and 0/false/no/off (any case), or ''
    for false; anything else is an error."""
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false, 1/0, yes/no or on/off)")


@dataclasses.dataclass(frozen=True)
class Deprecated:
    """An old flag (and its environment variable) that sets this field to
    ``value`` and warns."""

    flag: str
    value: Any
    advice: str


@dataclasses.dataclass(frozen=True)
class _Spec:
    help: str
    flag: str | None  # None: not a flag (set in code, or fixed)
    env: str | None  # the environment variable's name past the prefix (None: from the flag)
    parse: Callable[[str], Any] | None
    _: dataclasses.KW_ONLY
    choices: tuple[Any, ...] | None
    metavar: str | None
    deprecated: tuple[Deprecated, ...]
    section: str | None  # a nested settings dataclass, with this title
    many: bool = False  # a tuple: the flag takes one or more values, the variable commas


def setting(
    default: Any = None,
    help: str = "",
    *,
    flag: str | None = "",
    env: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[Any, ...] | None = None,
    metavar: str | None = None,
    deprecated: tuple[Deprecated, ...] = (),
    many: bool = False,
) -> Any:
    """A settings field. ``flag``: '' derives ``--field-name``; None makes it
    no flag. ``env``: the variable's name past the prefix (default: from the
    flag). ``parse``: text -> value for flag and environment alike (default:
    from the field's type). ``many``: a tuple of such values (``--flag A B``,
    or ``A,B`` in the environment)."""
    spec = _Spec(
        help,
        flag,
        env,
        parse,
        choices=choices,
        metavar=metavar,
        deprecated=deprecated,
        section=None,
        many=many,
    )
    return dataclasses.field(default=default, metadata={_KEY: spec})


def section(cls: type, title: str) -> Any:
    """A nested settings dataclass (its fields are flags of their own)."""
    spec = _Spec(
        "",
        flag=None,
        env=None,
        parse=None,
        choices=None,
        metavar=None,
        deprecated=(),
        section=title,
    )
    return dataclasses.field(default_factory=cls, metadata={_KEY: spec})


@dataclasses.dataclass(frozen=True)
class Flag:
    """One generated flag, as the parser and the documentation see it."""

    field: str  # dotted path from the top dataclass, e.g. "limits.max_n"
    flag: str
    env: str | None
    default: Any
    help: str
    kind: type


def flags_of(cls: type, prefix: str, only: frozenset[str] | None = None) -> Iterator[Flag]:
    """Every flag ``cls`` declares, nested sections included."""
    for path, f, spec, kind, _ in _walk(cls, ""):
        if spec.flag is None or (only is not None and path not in only):
            continue
        flag = spec.flag or "--" + f.name.replace("_", "-")
        env = prefix + (spec.env or flag.removeprefix("--").replace("-", "_").upper())
        yield Flag(path, flag, env if prefix else None, f.default, spec.help, kind)


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    env: Mapping[str, str] | None,
    prefix: str,
    *,
    only: frozenset[str] | None = None,
    rename: Mapping[str, str] | None = None,
) -> None:
    """Add ``cls``'s flags to ``parser``, their defaults read from ``env``
    (``prefix`` + the flag's name in capitals) when set there. ``only``: the
    dotted field paths to expose; ``rename``: path -> another flag name."""
    env = env or {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for path, f, spec, kind, optional in _walk(cls, ""):
        if spec.flag is None or (only is not None and path not in only):
            continue
        title = _section_title(cls, path)
        target = parser
        if title:
            target = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        declared = spec.flag or "--" + f.name.replace("_", "-")
        flag = (rename or {}).get(path) or declared
        env_name = prefix + (spec.env or declared.removeprefix("--").replace("-", "_").upper())
        parse = spec.parse or _parser_for(kind)
        default = f.default
        if env_name in env:
            # An empty variable leaves an optional setting unset.
            empty = optional and not env[env_name].strip()
            if spec.many:
                items = [t.strip() for t in env[env_name].split(",") if t.strip()]
                default = tuple(_from_env(env_name, t, parse) for t in items)
            else:
                default = None if empty else _from_env(env_name, env[env_name], parse)
        dest = path.replace(".", "__")
        extra: dict[str, Any] = {"dest": dest, "default": default, "help": _help(spec, env_name)}
        if kind is bool and spec.parse is None:
            target.add_argument(flag, action=argparse.BooleanOptionalAction, **extra)
        else:
            if spec.choices is not None:
                extra["choices"] = spec.choices
            else:
                extra["metavar"] = spec.metavar or f.name.upper()
            if spec.many:
                extra["nargs"] = "+"
            target.add_argument(flag, type=parse, **extra)
        for old in spec.deprecated:
            _add_deprecated(target, old, dest, prefix, env=env, prog=parser.prog)


def build(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """The (nested) settings object from parsed flags; ``fixed`` gives fields
    that are not flags (or overrides them)."""
    return _build(cls, vars(args), "", fixed)


def _build(cls: type, values: Mapping[str, Any], path: str, fixed: Mapping[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        here = path + f.name
        if f.name in fixed and not path:
            kwargs[f.name] = fixed[f.name]
        elif spec is not None and spec.section is not None:
            kwargs[f.name] = _build(type(f.default_factory()), values, here + ".", {})
        elif here.replace(".", "__") in values:
            value = values[here.replace(".", "__")]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def flatten(obj: Any) -> dict[str, Any]:
    """Field name -> value of every declared setting of a settings object,
    nested sections flattened (for reporting, e.g. GetServerInfo's
    server_args); fields set in code only are left out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        spec = f.metadata.get(_KEY)
        if spec is None:
            continue
        value = getattr(obj, f.name)
        out |= flatten(value) if spec.section is not None else {f.name: value}
    return out


# ------------------------------------------------------------------ helpers
def _walk(cls: type, path: str) -> Iterator[tuple[str, dataclasses.Field, _Spec, type, bool]]:
    """(dotted path, field, spec, value type, whether None is allowed) of every
    declared setting, sections walked into."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None:
            continue
        if spec.section is not None:
            yield from _walk(type(f.default_factory()), path + f.name + ".")
        else:
            hint = hints[f.name]
            optional = type(None) in typing.get_args(hint)
            yield path + f.name, f, spec, _base_type(hint), optional


def _section_title(cls: type, path: str) -> str:
    if "." not in path:
        return ""
    first = path.split(".", 1)[0]
    f = next(f for f in dataclasses.fields(cls) if f.name == first)
    return f.metadata[_KEY].section


def _base_type(hint: Any) -> type:
    """int for ``int | None``; the type itself otherwise."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return args[0]
    return hint


def _parser_for(kind: type) -> Callable[[str], Any]:
    if kind is bool:
        return parse_bool
    if kind in (int, float, str):
        return kind
    raise TypeError(f"settings of type {kind} need an explicit parse=")


def _from_env(name: str, text: str, parse: Callable[[str], Any]) -> Any:
    try:
        return parse(text)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: environment variable {name}={text!r}: {e}") from None


def _help(spec: _Spec, env_name: str) -> str:
    text = spec.help.replace("%", "%%")
    return f"{text} (env {env_name})" if text else f"(env {env_name})"


def _add_deprecated(
    target: Any, old: Deprecated, dest: str, prefix: str, *, env: Mapping[str, str], prog: str
) -> None:
    class _Warn(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None) -> None:
            _warn(prog, f"{old.flag} is deprecated; {old.advice}")
            setattr(namespace, dest, old.value)

    target.add_argument(old.flag, nargs=0, action=_Warn, help=argparse.SUPPRESS)
    env_name = prefix + old.flag.removeprefix("--").replace("-", "_").upper()
    if env_name in env and parse_bool(env[env_name]):
        _warn(prog, f"{env_name} is deprecated; {old.advice}")
        target.set_defaults(**{dest: old.value})


def _warn(prog: str, message: str) -> None:
    print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)


def markdown_rows(cls: type, prefix: str, who: str) -> list[str]:
    """One README table row per flag of ``cls``: who | flag | environment |
    default | what."""
    rows = []
    for f in flags_of(cls, prefix):
        default = "-" if f.default in (None, ()) else f.default
        if f.kind is bool:
            default = "on" if f.default else "off"
        text = f.help.replace("|", "\\|")
        flag = f"--[no-]{f.flag[2:]}" if f.kind is bool else f.flag
        rows.append(f"| {who} | `{flag}` | `{f.env}` | `{default}` | {text} |")
    return rows
