"""Reading JSON files a user hands in (configs, indexes, profiles) with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_json", "read_json_lines"]


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; ValueError naming the file when it is missing or not a JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def read_json_lines(path: Path) -> list:
    """The values of a JSON-lines file (blank lines skipped); ValueError naming the file and line otherwise."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ValueError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{str(path)!r} is not UTF-8 text: {error}") from None
    values = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                values.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{str(path)!r} line {number} is not valid JSON: {error}") from None
    return values
