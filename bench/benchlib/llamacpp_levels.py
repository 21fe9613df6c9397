"""llama.cpp built for one of pyloader's SIMD levels, for bench/llama_cpp.py ``--levels``.

Each level gets a virtual environment of its own under
``$PYLOADER_CACHE/llama-cpp-python/<level>/`` with llama-cpp-python
:data:`LLAMA_CPP_PYTHON_VERSION` compiled from PyPI by :func:`level_python`, with
``GGML_NATIVE=OFF`` and that level's ``GGML_*`` flags only (:func:`ggml_flags`). The
environment is rebuilt when its flags change; its llama.cpp must report the level's
instruction sets. :func:`engine` runs llamacpp_engine.py (llama.cpp's half of the
benchmark) in such a Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINE_SCRIPT = Path(__file__).resolve().parent / "llamacpp_engine.py"


#: The llama-cpp-python release the per-level environments build.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: pyloader's kernel levels that llama.cpp has a build for (baseline is SSE2/NEON alone).
LEVELS = ("avx2", "avx512", "amx")
_AVX2 = ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C")
#: AVX-512 extensions llama.cpp can use, by the /proc/cpuinfo flag that says a CPU has it.
_AVX512_EXTRAS = {"avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
                  "avx512_bf16": "AVX512_BF16"}
_AMX = ("AMX_TILE", "AMX_INT8", "AMX_BF16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def ggml_flags(level: str, flags: set[str] | None = None) -> list[str]:
    """The CMake arguments that build llama.cpp for ``level`` and no other: ``GGML_NATIVE``
    off, that level's instruction sets on, every other one off. ``avx512`` includes the
    AVX-512 extensions this CPU has (VBMI, VNNI, BF16): llama.cpp's strongest build without
    AMX; ``amx`` adds the tile instructions."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; expected one of {', '.join(LEVELS)}")
    flags = cpu_flags() if flags is None else flags
    on = list(_AVX2)
    if level in ("avx512", "amx"):
        on += ["AVX512"] + [g for f, g in _AVX512_EXTRAS.items() if f in flags]
    if level == "amx":
        on += list(_AMX)
    every = [*_AVX2, "AVX_VNNI", "AVX512", *_AVX512_EXTRAS.values(), *_AMX]
    return ["-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_BACKEND_DL=OFF",
            *(f"-DGGML_{g}={'ON' if g in on else 'OFF'}" for g in every)]


def python_has_llama(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import llama_cpp, gguf"], capture_output=True,
                              timeout=120, cwd=tempfile.gettempdir()).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def level_python(level: str, log=print) -> str:
    """The Python of the environment whose llama.cpp is built for ``level``, built first
    (llama-cpp-python from PyPI, compiled here: minutes) when missing or built with other
    flags."""
    from pyloader.compare.system import cache_dir

    root = cache_dir("llama-cpp-python", level)
    python = root / "bin" / "python"
    spec = {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "cmake_args": ggml_flags(level)}
    marker = root / "pyloader-build.json"
    if python.exists() and marker.exists() and json.loads(marker.read_text()) == spec \
            and python_has_llama(str(python)):
        return str(python)
    log(f"  building llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} for {level} in {root} "
        "(minutes)")
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    env = dict(os.environ, CMAKE_ARGS=" ".join(spec["cmake_args"]),
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    # No wheel cache: a wheel built for another level has the same name and version.
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-cache-dir",
                           f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "gguf", "numpy"],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building llama-cpp-python for {level} failed:\n"
                           f"{proc.stderr[-3000:]}")
    info = run_engine(str(python), "info")["system_info"]
    want_512 = level != "avx2"
    if "AVX2 = 1" not in info or ("AVX512 = 1" in info) != want_512:
        raise RuntimeError(f"llama.cpp built for {level} reports: {info}")
    marker.write_text(json.dumps(spec, indent=1))
    return str(python)


def machine_levels(asked: str) -> list[str]:
    """``asked`` (``all`` or a comma-separated list) as the levels to measure, each one
    this CPU and pyloader's build have."""
    import pyloader.kernels

    have = [lv for lv in pyloader.kernels.info()["isas"] if lv in LEVELS]
    levels = have if asked == "all" else asked.split(",")
    missing = [lv for lv in levels if lv not in have]
    if missing:
        raise SystemExit(f"--levels: this CPU or build lacks {missing}; it has {have}")
    return levels


def run_engine(python: str, *args: str) -> dict:
    """Runs bench/benchlib/llamacpp_engine.py in the llama.cpp Python; its JSON result."""
    proc = subprocess.run([python, str(ENGINE_SCRIPT), *args], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{ENGINE_SCRIPT.name} {args[0]} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
