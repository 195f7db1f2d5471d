"""Corpora of documents: the standard library's Python sources (on every machine with Python), a folder of text
files, or a jsonl file with a "text" field; and the deterministic train / validation split."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

__all__ = ["stdlib_texts", "load_corpus", "split_corpus"]

# Packages whose files are mostly data tables (codec maps, pydoc's topic strings), not Python.
_NOT_CODE = {"site-packages", "test", "tests", "encodings", "pydoc_data", "idlelib"}


def stdlib_texts(max_bytes: int = 4_000_000) -> list[str]:
    """The standard library's .py files, in name order, up to ``max_bytes`` in all (tests and data tables left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for file in sorted(root.rglob("*.py")):
        if _NOT_CODE.intersection(file.relative_to(root).parts):
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def load_corpus(path: str | Path | None = None, max_bytes: int = 8_000_000) -> list[str]:
    """Documents: the stdlib's .py files (None), every text file under a folder, or a jsonl's "text" fields."""
    if path is None:
        return stdlib_texts(max_bytes)
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--data {str(path)!r} does not exist")
    docs, total = [], 0
    if path.is_file():
        if path.suffix != ".jsonl":
            raise ValueError(f"--data {str(path)!r}: expected a folder of text files or a .jsonl file")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{str(path)!r} line {number}: expected a JSON object with a \"text\" string") from None
            docs.append(str(text))
            total += len(docs[-1])
            if total >= max_bytes:
                break
    else:
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            try:
                docs.append(file.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
            total += len(docs[-1])
            if total >= max_bytes:
                break
    docs = [d for d in docs if d.strip()]
    if len(docs) < 2:
        raise ValueError(f"--data {str(path)!r} holds {len(docs)} text documents; need at least 2 (train and validation)")
    return docs


def split_corpus(docs: list[str], val_every: int = 20) -> tuple[list[str], list[str]]:
    """(train, validation): every ``val_every``-th document (from the first) goes to validation."""
    val = [d for i, d in enumerate(docs) if i % val_every == 0]
    train = [d for i, d in enumerate(docs) if i % val_every != 0]
    return train, val
