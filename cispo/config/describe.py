"""The config written out, ``config.yaml`` (`save_yaml`), and described for people: ``cispo train --help``
(`format_help`: every field with its type, default and docstring, by section) and ``cispo train --print-config``
(`commented_yaml`: the full config as YAML, each field after its docstring). Both read the fields' docstrings
(`cispo.config.engine.field_docs`)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import yaml

from cispo.config.engine import KeyPath, _cispo_key, _class_doc, _dotted, _fields, _type_name, field_docs, to_dict
from cispo.config.foreign_names import OTHER_NAMES
from cispo.config.yaml_input import ConfigDumper


def commented_yaml(cfg: Any) -> str:
    """Every field of config ``cfg`` as YAML that `load_yaml` reads back to an equal config, each field
    after its docstring as comments (``cispo train --print-config``), each section after its class's."""
    lines = [f"# {type(cfg).__name__}: {_class_doc(type(cfg))} Every field, with its meaning (cispo train "
             "--print-config)."]

    def section(obj: Any, indent: str) -> None:
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            doc = docs[f.name] or (_class_doc(type(value)) if dataclasses.is_dataclass(value) else "")
            if not lines[-1].endswith(":"):  # a blank line between fields, none below a section's name
                lines.append("")
            lines.extend(f"{indent}# {line.strip()}".rstrip() for line in doc.splitlines())
            if dataclasses.is_dataclass(value):
                lines.append(f"{indent}{f.name}:")
                section(value, indent + "  ")
                continue
            text = yaml.dump(to_dict(value), Dumper=ConfigDumper, default_flow_style=True, width=10_000)
            lines.append(f"{indent}{f.name}: {text.removesuffix(chr(10)).removesuffix(chr(10) + '...').strip()}")

    section(cfg, "")
    return "\n".join(lines) + "\n"


def format_help(cls: type) -> str:
    """Every field of config ``cls``: dotted key, type, default and docstring, by section."""
    fields, out = _fields(cls), [
        "Config fields. Override any with KEY=VALUE: KEY is a dotted path (section.field) or a",
        "field name that occurs in one place only; VALUE is YAML (3e-4, true, null, [1, 2], {a: 1}).", ""]
    names = [n for n, o in OTHER_NAMES.items() if all(_cispo_key(cls, k) for k in o.keys)]
    if names:
        shown = ", ".join(names[:1] + [n for n in names if n.count(".") == 1][:1])
        out[-1:] = [f"TRL's and verl's names of these settings are read too, {len(names)} of them ({shown}, ...),",
                    "the same way here and in a YAML file: each as its cispo key, or refused saying how the two",
                    "differ. docs/integrations.md, \"TRL's and verl's names in cispo train\", lists them all.", ""]

    def section(c: type, prefix: KeyPath, title: str) -> None:
        out.append(title)
        subs, docs = [], field_docs(c)
        for f in dataclasses.fields(c):
            key = prefix + (f.name,)
            if dataclasses.is_dataclass(fields[key]):
                subs.append(key)
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(f"  {_dotted(key)}: {_type_name(fields[key])} = {default!r}")
            out.extend(f"      {line}".rstrip() for line in docs[f.name].splitlines())
        for key in subs:
            sub = fields[key]
            section(sub, key, f"\n{_dotted(key)} ({sub.__name__}): {_class_doc(sub)}")

    section(cls, (), f"{cls.__name__}: {_class_doc(cls)}")
    return "\n".join(out).rstrip() + "\n"


def save_yaml(cfg: Any, path: str | pathlib.Path) -> None:
    """Every field of a config (defaults included) as a YAML file that ``load_yaml`` reads
    back to an equal config. Parent folders are created."""
    text = yaml.dump(to_dict(cfg), Dumper=ConfigDumper, sort_keys=False, default_flow_style=False, width=88)
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"# {type(cfg).__name__}: {_class_doc(type(cfg))} Written by cispo.config.save_yaml; "
                      f"every field, defaults included.\n{text}", encoding="utf-8")
