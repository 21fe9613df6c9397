"""Where benchmark results live in the source tree: raw results under :data:`RAW`
(ignored by git), kept summaries in :data:`RESULTS` (:mod:`.results`)."""

from __future__ import annotations

import os
from pathlib import Path


def _repo() -> Path:
    """The source tree holding ``bench/`` (this file's, in a checkout or an editable
    install; ``$PYLOADER_REPO`` when set), else the working directory."""
    env = os.environ.get("PYLOADER_REPO")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[2]
    return here if (here / "bench").is_dir() else Path.cwd()


REPO = _repo()
RESULTS = REPO / "bench" / "results"
RAW = RESULTS / "raw"
