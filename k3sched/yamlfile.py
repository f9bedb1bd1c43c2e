"""Reading the small YAML files k3sched takes (configs, profiles, expert placements): a size-limited
UTF-8 read, a safe loader with YAML 1.2 floats and no duplicate keys, and one-line errors
(:class:`ConfigError`) that quote values briefly (:func:`show_value`)."""

from __future__ import annotations

import math
import re
import reprlib
from pathlib import Path
from typing import Any

import yaml

MAX_CONFIG_BYTES = 1 << 20
"""A config file larger than this (1 MiB) is refused unread: configs are a few hundred bytes."""


class ConfigError(ValueError):
    """A config is invalid. ``str(err)`` is one line: the field, what is wrong, what is allowed."""


class _Loader(yaml.SafeLoader):
    """Safe YAML with two fixes for configs: ``1e-3`` and ``1.5e3`` are floats (YAML 1.2; PyYAML's
    1.1 rules read them as strings), and a key given twice in one mapping is an error (PyYAML keeps
    the last silently)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:  # unhashable key: SafeLoader reports it
                    break
                if dup:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {show_value(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def yaml_load(text: str, where: str) -> Any:
    """Parse YAML ``text`` (see :class:`_Loader`); ConfigError naming ``where`` (a file or a ``--set``
    item) when it is not valid YAML."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML{at} ({problem}); allowed: YAML text") from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply to read; allowed: a few levels "
                          f"(sections of KEY: VALUE)") from None


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 40
_REPR.maxlevel = 2
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_MAX_SHOWN = 160


def show_value(value: Any) -> str:
    """``value`` as an error message quotes it: one short line, whatever its size or nesting."""
    if isinstance(value, float) and not math.isfinite(value):
        return {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan")
    text = _REPR.repr(value).replace("\n", " ")
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 3] + "..."


def read_text_file(path: str | Path, what: str, limit: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of a small file; ConfigError (one line naming the file) when it is missing, a
    directory, unreadable, larger than ``limit`` bytes or not UTF-8."""
    p = Path(path)
    try:
        if p.is_dir():
            raise ConfigError(f"{p}: cannot read {what} (it is a directory); allowed: a YAML file")
        if p.exists() and not p.is_file():
            raise ConfigError(f"{p}: cannot read {what} (not a regular file); allowed: a YAML file")
        with p.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read {what} ({e.strerror or e}); allowed: a readable YAML file") from None
    if len(raw) > limit:
        raise ConfigError(f"{p}: {what} is larger than {limit} bytes; allowed: a YAML file of at most {limit} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: {what} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                          f"allowed: a UTF-8 YAML file") from None
