"""The CPU kernels for Linux aarch64 (NEON), built and run here.

Compiles csrc/kernels (and the thread pool) with a self-test
(tests/native/kernels_selftest.cpp: every format against a float64 reference through the
C++ API) into a static aarch64 binary with zig's clang (the ``ziglang`` PyPI package),
warnings as errors, and runs it under qemu-user when ``qemu-aarch64`` is installed
(Debian: qemu-user; .ci/run installs it). Exits non-zero when the build fails or a product
is out of its bound; without qemu it says the binary was only compiled.

    python scripts/cross_kernels.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "aarch64-linux-musl"
SOURCES = ["csrc/kernels/dispatch.cpp", "csrc/kernels/matmul_baseline.cpp",
           "csrc/core/thread_pool.cpp", "csrc/core/platform.cpp",
           "tests/native/kernels_selftest.cpp"]


def main() -> int:
    start = time.monotonic()
    out = ROOT / "build" / "cross-kernels"
    out.mkdir(parents=True, exist_ok=True)
    binary = out / "kernels_selftest-aarch64"
    binary.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "ziglang", "c++", "-target", TARGET, "-static", "-O2",
           "-std=gnu++17", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}",
           *(str(ROOT / s) for s in SOURCES), "-o", str(binary)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    if build.returncode != 0 or not binary.exists():
        print(build.stderr, file=sys.stderr)
        print(f"cross_kernels: building for {TARGET} FAILED")
        return 1
    print(f"cross_kernels: built {binary.relative_to(ROOT)} for {TARGET} "
          f"in {time.monotonic() - start:.0f}s")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if qemu is None:
        print("cross_kernels: qemu-aarch64 not installed: compiled only, not run")
        return 0
    run = subprocess.run([qemu, str(binary)], capture_output=True, text=True, timeout=1200)
    print(run.stdout.rstrip())
    if run.returncode != 0:
        print(run.stderr, file=sys.stderr)
        print("cross_kernels: the aarch64 (NEON) kernels FAILED their self-test")
        return 1
    print(f"cross_kernels: ok under {Path(qemu).name} in {time.monotonic() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
