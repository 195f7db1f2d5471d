"""Reading JSON files a user hands in (configs, indexes, profiles) with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_json"]


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
