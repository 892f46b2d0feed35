"""Real-code corpus: the running interpreter's own standard library, split by file.

The reference models are trained on the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (no
download needed, and every Python install has them). ``site-packages`` and ``__pycache__`` are skipped,
as are files that are not valid UTF-8 (a few test fixtures are deliberately broken).

The split is by file, from a SHA-256 hash of the POSIX relative path, so it is deterministic, needs no
state, and a file never contributes to both sides. Held-out numbers therefore depend on the Python version
whose stdlib is read; the training script records it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CODE_HELD_OUT_PERCENT",
    "CODE_ROOT_ENV",
    "CodeFile",
    "code_split",
    "corpus_info",
    "read_code_files",
    "stdlib_root",
]

CODE_HELD_OUT_PERCENT = 5
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class CodeFile:
    """One source file of the corpus.

    Attributes:
        path: POSIX path relative to the stdlib root (the split key).
        text: file contents.
    """

    path: str
    text: str


CODE_ROOT_ENV = "KVARN_MLA_CODE_ROOT"


def stdlib_root() -> Path:
    """Directory of the corpus: ``$KVARN_MLA_CODE_ROOT`` if set (a copy of another interpreter's standard library, so
    that a run on another machine reads the same files), else the running interpreter's standard library."""
    override = os.environ.get(CODE_ROOT_ENV)
    return Path(override) if override else Path(sysconfig.get_paths()["stdlib"])


def code_split(relpath: str) -> str:
    """``"held_out"`` for ``CODE_HELD_OUT_PERCENT`` percent of files (by SHA-256 of ``relpath``), else ``"train"``."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big") % 100
    return "held_out" if bucket < CODE_HELD_OUT_PERCENT else "train"


def read_code_files(split: str, root: Path | None = None) -> list[CodeFile]:
    """All corpus files of one split, sorted by relative path.

    Args:
        split: ``"train"`` or ``"held_out"``.
        root: directory to read (default: :func:`stdlib_root`).

    Returns:
        The files; empty files and files that are not UTF-8 are left out.
    """
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split=}")
    root = stdlib_root() if root is None else Path(root)
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # pruned, not walked (site-packages is large)
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    files = []
    for p in sorted(found):
        rel = p.relative_to(root)
        if not p.is_file():
            continue
        relpath = rel.as_posix()
        if code_split(relpath) != split:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(CodeFile(relpath, text))
    return files


def corpus_info() -> dict[str, object]:
    """Provenance of the corpus for metrics files: Python version, the corpus path, and whether it was overridden."""
    return {
        "python": sys.version.split()[0],
        "stdlib": str(stdlib_root()),
        "code_root_override": bool(os.environ.get(CODE_ROOT_ENV)),  # set and not empty, as stdlib_root reads it
    }
