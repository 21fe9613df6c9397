"""Model locations: a local path, or a Hugging Face repo id found in the local hub cache.

:func:`resolve` returns a local path as is, else the cached snapshot of the repo at
``revision`` (branch, tag or commit prefix), downloading only when allowed; nothing here imports
mlx-lm. See docs/loading.md.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .._util.fs import path_error
from ..errors import ModelNotFoundError

#: The files mlx-lm downloads for a model (weights, configs, tokenizer, custom code).
DOWNLOAD_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                     "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{7,40}")
_TRUE = {"1", "true", "yes", "on"}


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache directory this process would use."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):  # huggingface_hub's older name
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """Downloads are disabled (``HF_HUB_OFFLINE``, or ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def is_repo_id(name: str) -> bool:
    """``name`` has the shape of a hub repo id (``org/name``, no leading ``/`` or ``.``)."""
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name


def cached_snapshot(repo_id: str, revision: str | None = None,
                    cache: Path | None = None) -> Path | None:
    """The snapshot directory of ``repo_id`` at ``revision`` in the hub cache, or None."""
    cache = hub_cache_dir() if cache is None else cache
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    rev = revision or "main"
    ref = repo / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
        snap = snapshots / commit
        return snap if snap.is_dir() else None
    if _COMMIT.fullmatch(rev):
        found = [d for d in snapshots.iterdir() if d.is_dir() and d.name.startswith(rev)]
        if len(found) == 1:
            return found[0]
    return None


def resolve(path_or_repo: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local path for ``path_or_repo`` (a path, or a repo id in the hub cache).

    Raises:
        ModelNotFoundError (a FileNotFoundError): not local, not cached, not downloadable.
    """
    if "\0" in os.fsdecode(path_or_repo):  # the kernel would see a shorter name
        raise path_error(path_or_repo, "checkpoint path")
    p = Path(os.fspath(path_or_repo)).expanduser()
    if p.exists() or p.is_symlink():  # a link to nothing or a loop: the reader says which
        return p
    name = os.fspath(path_or_repo)
    if not is_repo_id(name):
        raise ModelNotFoundError(f"{name}: no such file or directory (and not a Hugging "
                                 "Face repo id of the form 'org/name')")
    cache = hub_cache_dir()
    snap = cached_snapshot(name, revision, cache)
    if snap is not None:
        return snap
    rev = revision or "main"
    where = (f"{name}: not a local path, and revision {rev!r} of the Hugging Face repo is "
             f"not in the hub cache {cache}")
    if offline():
        raise ModelNotFoundError(f"{where}; HF_HUB_OFFLINE is set, so nothing is downloaded "
                                 "(download it where the hub is reachable, or unset "
                                 "HF_HUB_OFFLINE)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(f"{where}; downloading it needs huggingface_hub "
                                 "(pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(name, revision=revision,
                                      allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as exc:  # network, auth, missing repo: one typed error
        raise ModelNotFoundError(f"{where}, and the download failed: {exc}") from exc


