"""The extension's guard rails: MLX version pin, page rounding of hints."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np

import pyloader
from helpers import write_raw_safetensors


def test_import_refuses_a_different_mlx(tmp_path):
    code = ("import mlx.core as mx; mx.__version__ = '0.0.1'\n"
            "try:\n    import pyloader\nexcept ImportError as e:\n    print('IMPORTERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "IMPORTERROR" in out.stdout
    assert "0.0.1" in out.stdout and pyloader._core.mlx_build_version in out.stdout


def test_arrays_are_mlx_arrays(aligned_file):
    for strategy in ("mmap", "pread"):
        a = pyloader.load(aligned_file, strategy)["f32"]
        assert type(a) is mx.array
        assert (a + 1).dtype == mx.float32


def test_dontneed_rounds_inward(tmp_path):
    """DONTNEED on a tensor must not drop a page it shares with a neighbour.

    Writing through numpy into a mapped array makes a private copy-on-write
    page; dropping that page would silently lose the write. So: write into
    tensor A, advise DONTNEED on neighbour B that shares A's page, and the
    write must survive. DONTNEED on A itself (covering its whole pages) does
    drop it, showing the probe can fail."""
    page = 4096
    a = np.zeros(page // 4, dtype=np.float32)         # fills one page exactly
    b = np.ones(page // 4 + 10, dtype=np.float32)      # straddles into the next page
    path = tmp_path / "pages.safetensors"
    tensors = {"a": ("F32", [a.size], a.tobytes()), "b": ("F32", [b.size], b.tobytes()),
               "c": ("U8", [16], bytes(range(16)))}  # shares b's tail page
    # Pad the header so tensor "a" starts exactly on a page boundary.
    write_raw_safetensors(path, tensors)
    start = pyloader.open(path).index.files[0].data_start
    write_raw_safetensors(path, tensors, header_pad=(-start) % page)
    ckpt = pyloader.open(path)
    assert ckpt["a"].offset % page == 0 and ckpt["b"].offset % page == 0

    reader = pyloader.MmapReader(path)
    arr_a, arr_b = reader.get("a"), reader.get("b")
    view_a = np.array(arr_a, copy=False)
    view_b = np.array(arr_b, copy=False)
    view_b[-1] = 42.0  # COW the tail page "b" shares with "c"
    # "b" ends 40 bytes into its second page, which "c" shares: DONTNEED on "b"
    # rounds inward to its first page only, so the written tail page survives.
    assert reader.advise("b", "dontneed")
    assert view_b[-1] == 42.0
    # A range that covers a whole page does drop the private copy.
    view_a[0] = 7.0
    assert reader.advise("a", "dontneed")
    assert view_a[0] == 0.0  # page re-read from the file
    # The file itself was never modified.
    assert np.array_equal(np.array(pyloader.load(path, "pread")["b"]), b)
