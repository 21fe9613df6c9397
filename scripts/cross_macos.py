#!/usr/bin/env python3
"""Cross-compile pyloader's extension for Apple Silicon and check the result.

    python scripts/cross_macos.py [--jobs N] [--cache DIR]

What it does (proves the macOS build compiles and links without a Mac; run by .ci/run on
Linux):

1. ``pip download`` MLX's macOS arm64 wheels (``mlx`` and ``mlx-metal``, the version
   this environment's ``mlx`` is) into ``--cache`` (default ``build/macos-cross``,
   gitignored) and unpacks them: MLX's macOS headers and ``libmlx.dylib``.
2. Compiles every file under ``csrc/`` (core, kernels, mlxio, mlxops, bindings) and nanobind's own
   sources for ``aarch64-macos.14.0`` with the clang of the ``ziglang`` PyPI package,
   ``-std=gnu++20`` as the real build (MLX's CMake target exports ``cxx_std_20``),
   ``-Wall -Wextra``, and ``-Werror`` for ``csrc/core`` (the platform layer). Objects
   go to a throwaway directory (zig mishandles ``-fsyntax-only``).
3. Links ``_core`` as a Mach-O image against the wheel's ``libmlx.dylib``
   (``-undefined dynamic_lookup``: Python's C API comes from the interpreter at run
   time; ``-nostdlib++``: the C++ runtime is the system's libc++, which libmlx.dylib
   loads) with the rpath ``@loader_path/../mlx/lib`` that CMakeLists.txt gives it.
   zig's Mach-O linker has no ``-bundle``, so the image is an ``MH_DYLIB`` (what
   PyO3/maturin extension modules are; ``dlopen``, and so Python's import, loads
   either); on a Mac, CMake links the same objects as an ``MH_BUNDLE``.
4. Reads the image's load commands: arm64, ``LC_RPATH @loader_path/../mlx/lib``,
   ``LC_LOAD_DYLIB @rpath/libmlx.dylib``, every MLX symbol bound to that
   libmlx.dylib (it exports them all), and nothing left to run-time lookup but
   Python's C API and the C++ runtime.

5. Runs the wheel repair the macOS wheels get, delocate's own: the command in
   ``pyproject.toml [tool.cibuildwheel.macos] repair-wheel-command`` on a wheel made
   from the cross-linked ``_core``, and ``delocate-listdeps --all`` on it. delocate is
   pure Python but asks Apple's ``otool``/``lipo`` for what it reads; this script
   answers as them (``--as otool|lipo``, from the same load commands as step 4) and
   stands in for ``install_name_tool``/``codesign`` with tools that fail, so a repair
   that would have to rewrite the image (copy a library in) fails here too. The
   repaired wheel must hold no ``libmlx``. What it cannot show: codesign on a Mac, and
   delocate reading a bundle (MH_BUNDLE, no install id) where this image is a dylib.

Python's headers are this interpreter's (Linux) ones: the C API's declarations are
the same, and nothing here is run. Exits 1 listing each failure; prints the time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "aarch64-macos.14.0"
RPATH = "@loader_path/../mlx/lib"

# Mach-O constants (<mach-o/loader.h>, <mach-o/nlist.h>).
MH_MAGIC_64 = 0xFEEDFACF
MH_DYLIB, MH_BUNDLE = 0x6, 0x8
CPU_TYPE_ARM64 = 0x0100000C
LC_SYMTAB = 0x2
LC_LOAD_DYLIB = 0xC
LC_ID_DYLIB = 0xD
LC_LOAD_WEAK_DYLIB = 0x80000018
LC_REEXPORT_DYLIB = 0x8000001F
LC_RPATH = 0x8000001C
N_EXT, N_TYPE, N_UNDF = 0x01, 0x0E, 0x0
# What may stay unbound until run time: the interpreter's C API and the C++ runtime
# (std::, the ABI's __cxa_*, operator new/delete, type info), both in the process
# before the extension is loaded.
RUNTIME_LOOKUP = ("_Py", "__Py", "__ZNSt", "__ZNKSt", "__ZSt", "__ZTISt", "__ZTVSt", "__ZTSSt",
                  "__ZTINSt", "__ZTVNSt", "__ZTSNSt", "__ZTTNSt", "__ZTIN10__cxxabiv1", "__ZTVN10__cxxabiv1",
                  "___cxa_", "___gxx_personality", "___dynamic_cast", "__Znw", "__Zna", "__Zdl",
                  "__Zda")


def mlx_version() -> str:
    from importlib.metadata import version
    return version("mlx")


def fetch_sdk(cache: Path, ver: str) -> Path:
    """MLX's macOS wheels, unpacked: returns the directory holding ``mlx/``."""
    sdk = cache / f"sdk-{ver}"
    if (sdk / "mlx" / "lib" / "libmlx.dylib").exists():
        return sdk
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--platform", "macosx_14_0_arm64",
                    "--python-version", "3.11", "-d", str(wheels),
                    f"mlx=={ver}", f"mlx-metal=={ver}"], check=True)
    tmp = cache / f"sdk-{ver}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for whl in sorted(wheels.glob(f"mlx*-{ver}-*macosx*arm64.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(tmp)
    if not (tmp / "mlx" / "lib" / "libmlx.dylib").exists():
        sys.exit(f"cross_macos: no mlx/lib/libmlx.dylib in the wheels in {wheels}")
    tmp.rename(sdk)
    return sdk


def nanobind_sources() -> tuple[Path, list[Path]]:
    """nanobind's directory and the sources its CMake builds into the static library
    (the list in nanobind_build_library, without the free-threaded-only nb_ft.cpp)."""
    import nanobind
    nb = Path(nanobind.__file__).parent
    cmake = (nb / "cmake" / "nanobind-config.cmake").read_text()
    block = cmake[cmake.index("function (nanobind_build_library"):]
    block = block[:block.index("endfunction")]
    names = dict.fromkeys(re.findall(r"\$\{NB_DIR\}/src/(\w+\.cpp)", block))
    names.pop("nb_ft.cpp", None)
    return nb, [nb / "src" / n for n in names]


def compile_jobs(sdk: Path) -> list[tuple[Path, list[str]]]:
    """(source, flags) for every translation unit of the extension."""
    nb, nb_srcs = nanobind_sources()
    py_inc = sysconfig.get_paths()["include"]
    mlx_inc = ["-isystem", str(sdk / "mlx" / "include")]
    base = ["-target", TARGET, "-O1", "-fPIC"]
    core = [*base, "-std=gnu++20", "-Wall", "-Wextra", f"-I{ROOT / 'csrc'}", *mlx_inc]
    nb_inc = [f"-I{py_inc}", f"-I{nb / 'include'}"]
    jobs = []
    for src in sorted((ROOT / "csrc" / "core").glob("*.cpp")):
        jobs.append((src, [*core, "-Werror"]))  # the platform layer: warnings are errors
    for src in sorted((ROOT / "csrc" / "kernels").glob("*.cpp")):
        jobs.append((src, [*core, "-Werror"]))  # the kernels' NEON build: warnings are errors
    for src in [*sorted((ROOT / "csrc" / "mlxio").glob("*.cpp")),
                *sorted((ROOT / "csrc" / "mlxops").glob("*.cpp"))]:
        jobs.append((src, core))
    for src in sorted((ROOT / "csrc" / "bindings").glob("*.cpp")):
        jobs.append((src, [*core, *nb_inc, "-fvisibility=hidden", "-DNB_DOMAIN=mlx",
                           f'-DPYLOADER_MLX_VERSION="{mlx_version()}"']))
    for src in nb_srcs:
        jobs.append((src, [*base, "-std=gnu++17", "-fvisibility=hidden", "-fno-strict-aliasing",
                           "-DNB_BUILD", "-DNB_COMPACT_ASSERTIONS", *nb_inc,
                           "-isystem", str(nb / "ext" / "robin_map" / "include")]))
    return jobs


def zig_cxx(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ziglang", "c++", *args],
                          capture_output=True, text=True)


def load_commands(path: Path) -> dict:
    """The parts of a Mach-O file's header and load commands this check needs."""
    data = path.read_bytes()
    magic, cputype, _sub, filetype, ncmds, _size, _flags, _res = struct.unpack_from("<8I", data)
    if magic != MH_MAGIC_64:
        raise ValueError(f"{path}: not a 64-bit Mach-O file (magic {magic:#x})")
    # undefined: (library ordinal, name); ordinals count LC_*_DYLIB from 1, and
    # 0 / 0xFE mean "looked up at run time".
    out = {"cputype": cputype, "filetype": filetype, "rpaths": [], "dylibs": [],
           "undefined": [], "id": None, "versions": {}}
    at = 32  # sizeof(mach_header_64)

    def cstr(off: int) -> str:
        return data[off:data.index(b"\0", off)].decode()

    for _ in range(ncmds):
        cmd, size = struct.unpack_from("<2I", data, at)
        if cmd == LC_RPATH:
            (name_off,) = struct.unpack_from("<I", data, at + 8)
            out["rpaths"].append(cstr(at + name_off))
        elif cmd in (LC_LOAD_DYLIB, LC_LOAD_WEAK_DYLIB, LC_REEXPORT_DYLIB, LC_ID_DYLIB):
            name_off, _stamp, current, compat = struct.unpack_from("<4I", data, at + 8)
            name = cstr(at + name_off)
            out["versions"][name] = (compat, current)
            if cmd == LC_ID_DYLIB:
                out["id"] = name
            else:
                out["dylibs"].append(name)
        elif cmd == LC_SYMTAB:
            symoff, nsyms, stroff, _strsize = struct.unpack_from("<4I", data, at + 8)
            for i in range(nsyms):
                strx, ntype, _sect, desc, _value = struct.unpack_from("<IBBHQ", data,
                                                                      symoff + 16 * i)
                if ntype & N_EXT and (ntype & N_TYPE) == N_UNDF:
                    out["undefined"].append(((desc >> 8) & 0xFF, cstr(stroff + strx)))
        at += size
    return out


def check_image(path: Path) -> list[str]:
    lc = load_commands(path)
    problems = []
    if lc["cputype"] != CPU_TYPE_ARM64:
        problems.append(f"cputype {lc['cputype']:#x}, not arm64")
    if lc["filetype"] not in (MH_DYLIB, MH_BUNDLE):
        problems.append(f"filetype {lc['filetype']}, not a loadable image")
    if lc["rpaths"] != [RPATH]:
        problems.append(f"LC_RPATH {lc['rpaths']}, expected [{RPATH!r}]")
    if "@rpath/libmlx.dylib" not in lc["dylibs"]:
        problems.append(f"no LC_LOAD_DYLIB @rpath/libmlx.dylib (has {lc['dylibs']})")
        return problems
    mlx = lc["dylibs"].index("@rpath/libmlx.dylib") + 1
    from_mlx = [n for o, n in lc["undefined"] if o == mlx]
    unbound = [n for o, n in lc["undefined"] if o in (0, 0xFE)]
    stray = [n for n in unbound if not n.startswith(RUNTIME_LOOKUP)]
    if not from_mlx:
        problems.append("no symbol bound to libmlx.dylib")
    if stray:
        problems.append(f"{len(stray)} symbols left to run-time lookup that neither "
                        "libmlx.dylib, Python nor the C++ runtime provides, e.g. "
                        + ", ".join(stray[:5]))
    print(f"cross_macos: {path.name}: arm64 "
          f"{'MH_DYLIB' if lc['filetype'] == MH_DYLIB else 'MH_BUNDLE'}, LC_RPATH {lc['rpaths']}, "
          f"LC_LOAD_DYLIB {lc['dylibs']}; {len(from_mlx)} symbols from libmlx.dylib, "
          f"{len(unbound)} from Python and the C++ runtime")
    return problems


def version_str(v: int) -> str:
    return f"{v >> 16}.{(v >> 8) & 0xFF}.{v & 0xFF}"


def as_tool(tool: str, args: list[str]) -> int:
    """Answer as Apple's ``otool -arch all -m -L|-D|-l FILE`` or ``lipo -info FILE`` for
    what delocate asks (the formats its parsers, delocate/tools.py, read)."""
    path = args[-1]
    try:
        lc = load_commands(Path(path))
    except (ValueError, struct.error):
        print(f"{path}: is not an object file")
        return 1 if tool == "lipo" else 0
    if lc["cputype"] != CPU_TYPE_ARM64:
        print(f"{path}: unexpected cputype {lc['cputype']:#x}", file=sys.stderr)
        return 1
    if tool == "lipo":
        print(f"Non-fat file: {path} is architecture: arm64")
        return 0
    print(f"{path}:")
    if "-D" in args:
        if lc["id"]:
            print(lc["id"])
    elif "-L" in args:
        for name in ([lc["id"]] if lc["id"] else []) + lc["dylibs"]:
            compat, current = lc["versions"][name]
            print(f"\t{name} (compatibility version {version_str(compat)}, "
                  f"current version {version_str(current)})")
    elif "-l" in args:
        for rpath in lc["rpaths"]:
            print(f"          cmd LC_RPATH\n      cmdsize 0\n         path {rpath} (offset 12)")
    else:
        print(f"cross_macos --as otool: unsupported arguments {args}", file=sys.stderr)
        return 1
    return 0


def repair_command() -> str:
    import tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["cibuildwheel"]["macos"]["repair-wheel-command"]


def make_wheel(image: Path, out: Path) -> Path:
    """A macOS arm64 wheel of the package's Python files and the cross-linked image."""
    import base64
    import hashlib
    name, ver = "pyloader_mlx", "0.0.0"
    whl = out / f"{name}-{ver}-cp311-cp311-macosx_14_0_arm64.whl"
    dist = f"{name}-{ver}.dist-info"
    files = {f"pyloader/{image.name}": image.read_bytes(), "pyloader/__init__.py": b"",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: pyloader-mlx\nVersion: {ver}\n"
             .encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: cross_macos\nRoot-Is-Purelib: false\n"
             b"Tag: cp311-cp311-macosx_14_0_arm64\n"}
    record = []
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files.items():
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{arc},sha256={digest.decode()},{len(data)}")
        record.append(f"{dist}/RECORD,,")
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return whl


def check_repair(image: Path, cache: Path, command: str) -> list[str]:
    """Runs `command` (cibuildwheel's repair-wheel-command) and delocate-listdeps on a
    wheel of `image`, with this script answering as otool and lipo."""
    work = cache / "repair"
    shutil.rmtree(work, ignore_errors=True)
    (work / "bin").mkdir(parents=True)
    (work / "dest").mkdir()
    me = Path(__file__).resolve()
    for tool in ("otool", "lipo"):
        shim = work / "bin" / tool
        shim.write_text(f"#!/bin/sh\nexec {sys.executable} {me} --as {tool} \"$@\"\n")
        shim.chmod(0o755)
    for tool in ("install_name_tool", "codesign"):  # a repair that rewrites needs a Mac
        shim = work / "bin" / tool
        shim.write_text(f"#!/bin/sh\necho 'cross_macos: {tool} runs only on a Mac' >&2\nexit 1\n")
        shim.chmod(0o755)
    whl = make_wheel(image, work)
    env = dict(os.environ, PATH=f"{work / 'bin'}{os.pathsep}{Path(sys.executable).parent}"
               f"{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = (command.replace("{delocate_archs}", "arm64").replace("{dest_dir}", str(work / "dest"))
           .replace("{wheel}", str(whl)))
    problems = []
    deps = subprocess.run([sys.executable, "-m", "delocate.cmd.delocate_listdeps", "--all",
                           str(whl)], env=env, capture_output=True, text=True)
    print(f"cross_macos: delocate-listdeps --all: {deps.stdout.strip() or deps.stderr.strip()}")
    if deps.returncode != 0:
        problems.append(f"delocate-listdeps failed: {deps.stderr.strip()[-500:]}")
    print(f"cross_macos: repair: {cmd}")
    repair = subprocess.run(cmd, shell=True, env=env, capture_output=True, text=True)
    if repair.returncode != 0:
        problems.append("the repair command failed: "
                        + (repair.stderr.strip() or repair.stdout.strip())[-800:])
        return problems
    out = sorted((work / "dest").glob("*.whl"))
    if len(out) != 1:
        return problems + [f"the repair wrote {len(out)} wheels, expected 1"]
    names = zipfile.ZipFile(out[0]).namelist()
    if any("libmlx" in n for n in names):
        problems.append(f"the repaired wheel {out[0].name} contains libmlx: {names}")
    print(f"cross_macos: repaired {out[0].name}: {len(names)} files, no libmlx"
          if not problems else "")
    return problems


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--as":
        return as_tool(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--cache", type=Path, default=ROOT / "build" / "macos-cross",
                    help="wheels, unpacked SDK and objects (default build/macos-cross)")
    ap.add_argument("--repair-command", default=None,
                    help="the wheel repair to check (default: pyproject.toml's "
                         "[tool.cibuildwheel.macos] repair-wheel-command)")
    ap.add_argument("--repair-only", action="store_true",
                    help="check the repair of the image a previous run linked; no compile")
    args = ap.parse_args()
    image = args.cache / "_core.cpython-311-darwin.so"
    if args.repair_only:
        problems = check_repair(image, args.cache, args.repair_command or repair_command())
        for p in problems:
            print(f"cross_macos: {p}")
        print(f"cross_macos: repair {'FAILED' if problems else 'ok'}")
        return 1 if problems else 0
    start = time.monotonic()
    sdk = fetch_sdk(args.cache, mlx_version())
    objs = args.cache / "obj"
    shutil.rmtree(objs, ignore_errors=True)
    objs.mkdir(parents=True)
    jobs = compile_jobs(sdk)

    def build(job: tuple[Path, list[str]]) -> tuple[Path, Path, subprocess.CompletedProcess]:
        src, flags = job
        rel = src.relative_to(ROOT) if src.is_relative_to(ROOT) else Path("nanobind") / src.name
        obj = objs / (str(rel).replace("/", "_") + ".o")
        return rel, obj, zig_cxx(*flags, "-c", str(src), "-o", str(obj))

    errors = 0
    failed = []
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(build, jobs))
    for rel, _obj, proc in results:
        n = len(re.findall(r"\berror:", proc.stderr))
        if proc.returncode != 0:
            errors += max(n, 1)
            failed.append(f"{rel} ({n} errors)")
            print(proc.stderr, file=sys.stderr)
        elif proc.stderr.strip():
            print(proc.stderr, file=sys.stderr)  # warnings outside the platform layer
    print(f"cross_macos: compiled {len(jobs)} files for {TARGET} in "
          f"{time.monotonic() - start:.0f}s: {errors} errors"
          + (f" in {len(failed)} files: " + ", ".join(failed) if failed else ""))
    if failed:
        return 1

    image.unlink(missing_ok=True)
    mlx_lib = sdk / "mlx" / "lib"
    link = zig_cxx("-target", TARGET, "-shared", "-undefined", "dynamic_lookup", "-nostdlib++",
                   *(str(o) for _, o, _ in results), f"-L{mlx_lib}", "-lmlx",
                   f"-Wl,-rpath,{RPATH}", "-o", str(image))
    if link.returncode != 0 or not image.exists():
        print(link.stderr, file=sys.stderr)
        print("cross_macos: linking the Mach-O image failed")
        return 1
    problems = check_image(image)
    if not problems:
        problems += check_repair(image, args.cache, args.repair_command or repair_command())
    for p in problems:
        print(f"cross_macos: {image.name}: {p}")
    print(f"cross_macos: {'FAILED' if problems else 'ok'} in {time.monotonic() - start:.0f}s "
          f"({args.jobs} jobs)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
