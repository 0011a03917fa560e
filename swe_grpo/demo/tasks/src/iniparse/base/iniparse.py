"""A tiny INI parser: `[section]` headers, `key = value` pairs, `;` and `#` comment lines."""

from __future__ import annotations


class ParseError(ValueError):
    """The text is not valid INI; the message names the line."""


def parse(text: str) -> dict[str, dict[str, str]]:
    """The sections of `text` as {section: {key: value}}; keys before the first section go under ""."""
    sections: dict[str, dict[str, str]] = {"": {}}
    current = sections[""]
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith((";", "#")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1].strip(), {})
        elif "=" in line:
            key, value = line.split("=")
            current[key.strip()] = value.strip()
        else:
            raise ParseError(f"line {number}: expected [section] or key = value, got {raw!r}")
    return sections
