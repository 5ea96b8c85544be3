"""Config files as data: YAML (with the loader's guards) or TOML, and ``key=value`` overrides applied to them.

:mod:`moga.train.config` validates what these return into a run's typed schema.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

try:  # TOML configs: the standard library's reader from Python 3.11, else the tomli package where installed
    import tomllib
except ModuleNotFoundError:
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None



class ConfigError(ValueError):
    """A config that cannot run: unknown key, wrong type, or values that contradict each other."""



# A config is small: these caps refuse a hostile file (a billion-laughs alias bomb is 1 KB of YAML that
# expands to 10^9 values) in milliseconds instead of minutes and gigabytes later.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000
MAX_CONFIG_DEPTH = 64  # a config nests a few levels; deeper would overflow the stack of whatever reads it next


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads 1e-3 as a string; learning rates are written that way, so read them as floats.
    A key given twice is an error (YAML would silently keep the last value)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {seen[key].line + 1}): give each key "
                    "once", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?\.[0-9]+(?:[eE][-+]?[0-9]+)?$"),
    list("-+0123456789."),
)


def _check_expanded_size(data: Any, where: str) -> None:
    """Aliases share one object however often they are used; count the values as if each use were a copy."""
    budget, stack = MAX_CONFIG_VALUES, [(data, 0)]
    while stack:
        node, depth = stack.pop()
        budget -= 1
        if budget < 0:
            raise ConfigError(f"{where}: more than {MAX_CONFIG_VALUES} values once YAML aliases are expanded "
                              "(an alias bomb?); a config is a few hundred values at most")
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(_too_deep(where))
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _too_deep(where: str) -> str:
    return f"{where}: nested more than {MAX_CONFIG_DEPTH} levels deep; a config nests a few"


def _load_yaml(text: str, where: str) -> Any:
    try:
        data = yaml.load(text, Loader=_Loader)
    except RecursionError:  # the parser recurses once per level
        raise ConfigError(_too_deep(where)) from None
    _check_expanded_size(data, where)
    return data


def parse_value(text: str) -> Any:
    """An override value as a YAML scalar (or flow list/dict): 0.1, 1e-3, true, null, [0.9, 0.95], adamw. A
    sweep's cells repeat the same few values (``moga reproduce --list`` parses 6k): each is parsed once, and
    every caller gets its own copy."""
    return copy.deepcopy(_parsed_value(text))


@lru_cache(maxsize=4096)
def _parsed_value(text: str) -> Any:
    try:
        return _load_yaml(text, f"override value {text[:40]!r}")
    except yaml.constructor.ConstructorError as e:
        raise ConfigError(f"override value {text!r}: {e.problem}") from None
    except yaml.YAMLError:
        return text


def resolve_config_path(path: str | Path) -> Path:
    """``path``, or, when it does not exist and reads ``configs/...`` (the README's examples), the copy that
    ships inside the installed package, so that the README's commands run outside a repository checkout."""
    path = Path(path)
    if path.exists() or path.is_absolute() or path.parts[:1] != ("configs",):
        return path
    bundled = Path(__file__).resolve().parent.parent / path  # moga/configs/... in the package
    return bundled if bundled.is_file() else path


def read_config_file(path: str | Path) -> dict:
    path = resolve_config_path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size} bytes is not a config (the limit is {MAX_CONFIG_BYTES} bytes)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    if path.suffix.lower() == ".toml":
        if tomllib is None:
            raise ConfigError("TOML configs need Python 3.11+ or the tomli package; or write the config in YAML")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        except RecursionError:
            raise ConfigError(_too_deep(str(path))) from None
        _check_expanded_size(data, str(path))
    else:
        try:
            data = _load_yaml(text, str(path))
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of sections, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Apply dotted ``key=value`` overrides (``optim.lr=0.1``) to a nested dict, in place."""
    for item in overrides or ():
        key, sep, value = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value (for example optim.lr=0.01)")
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = parse_value(value)
    return data
