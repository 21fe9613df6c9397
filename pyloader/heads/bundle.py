"""The head-bundle format and its builder. See docs/heads-and-repack.md."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._util.fs import (
    check_destination,
    commit,
    fault_point,
    remove,
    remove_stale,
    renamed_error,
    tmp_sibling,
)
from .._util.names import count_layers, layer_of, layer_order
from ..errors import HeadError, HeadMismatchError, TrunkMismatchError, UnknownHeadError
from ..io.checkpoint import Checkpoint, TensorMeta
from ..io.config import read_config_file
from ..io.writer import DEFAULT_ALIGN, check_align, write_aligned_file

TRUNK_FILE = "trunk.safetensors"
HEADS_DIR = "heads"
META_HEADS = "pyloader.heads"
META_HEAD = "pyloader.head"
FORMAT_VERSION = 1
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Non-layer tensors that come after the decoder layers.
_FINAL_RE = re.compile(r"(?:^|\.)(?:norm|final_layernorm|ln_f|lm_head)\.")
# Config keys that describe where a checkpoint came from, not what it computes.
_INFO_KEYS = {"_name_or_path", "transformers_version", "pyloader_gguf_source", "architectures",
              "torch_dtype", "quantization_config"}


#: Decoder layers in a checkpoint from its tensor names (highest layer index + 1).
num_layers = count_layers


def is_head_tensor(name: str, layers: int, tail: int) -> bool:
    """Whether the tensor is in one of the last ``tail`` layers, the final norm or lm_head."""
    i = layer_of(name)
    if i is not None:
        return i >= layers - tail
    return _FINAL_RE.search(name) is not None


def _config(path: Path) -> dict:
    p = (path if path.is_dir() else path.parent) / "config.json"
    try:
        return read_config_file(p)  # a FIFO is refused, not read
    except FileNotFoundError:
        return {}


def _crc_file(path: str, metas: list[TensorMeta]) -> dict[str, int]:
    """CRC-32 of each tensor's bytes, read through a read-only mapping."""
    out = {}
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return {t.name: 0 for t in metas}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as mv:
            for t in metas:
                with mv[t.offset:t.offset + t.nbytes] as part:
                    out[t.name] = zlib.crc32(part)
    return out


@dataclass
class BuildResult:
    """What :func:`build` wrote."""

    path: str
    tail: int
    layers: int
    trunk_tensors: int
    trunk_bytes: int
    heads: dict[str, int] = field(default_factory=dict)  # name -> head bytes


def _first_difference(base: Checkpoint, other: Checkpoint, names: list[str]) -> str | None:
    """The first tensor (in layer order) whose bytes differ, or None."""
    views: dict[str, memoryview] = {}
    with contextlib.ExitStack() as stack:

        def view(path: str) -> memoryview:
            if path not in views:
                f = stack.enter_context(open(path, "rb"))
                mm = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                views[path] = stack.enter_context(memoryview(mm))
            return views[path]

        for n in names:
            a, b = base[n], other[n]
            if a.dtype != b.dtype or a.shape != b.shape or (
                    a.nbytes and view(a.file)[a.offset:a.offset + a.nbytes]
                    != view(b.file)[b.offset:b.offset + b.nbytes]):
                return n
        return None


def build(base: str | os.PathLike[str], heads: dict[str, str | os.PathLike[str]], tail: int,
          out: str | os.PathLike[str], *, align: int = DEFAULT_ALIGN,
          overwrite: bool = False) -> BuildResult:
    """Build a head bundle.

    Args:
        base: The base model directory; its trunk is stored once.
        heads: Head name -> model directory of a variant (may be the base itself).
        tail: Decoder layers in each head (plus the final norm and ``lm_head``).
        out: Bundle directory, written atomically.
        align: Boundary of every tensor.
        overwrite: Replace an existing ``out`` that is a head bundle (or empty).

    Raises:
        TrunkMismatchError: a variant's trunk differs from the base's (first tensor named).
        HeadMismatchError: a variant's configuration or quantization differs.
        ValueError: bad head names or ``tail``; ``out`` is or holds a source.
        FileExistsError: ``out`` exists and ``overwrite`` is False, or is not a bundle.
    """
    check_align(align)
    base_p, out_p = Path(base), Path(out)
    if not heads:
        raise ValueError("a bundle needs at least one head")
    for name in heads:
        if not NAME_RE.fullmatch(name):
            raise ValueError(f"invalid head name {name!r} (letters, digits, '_', '-', '.')")
    base_ck = Checkpoint(base_p)
    names = base_ck.keys()
    layers = count_layers(names)
    if isinstance(tail, bool) or not isinstance(tail, int) or not 1 <= tail <= layers:
        raise ValueError(f"tail must be between 1 and the model's {layers} layers, got {tail!r}")
    head_names = sorted((n for n in names if is_head_tensor(n, layers, tail)),
                        key=layer_order)
    trunk_names = sorted((n for n in names if n not in set(head_names)), key=layer_order)
    base_cfg = _config(base_p)

    variants: dict[str, Checkpoint] = {}
    for name, src in heads.items():
        ck = Checkpoint(src)
        missing = sorted(set(names) - set(ck.keys()), key=layer_order)
        extra = sorted(set(ck.keys()) - set(names), key=layer_order)
        if missing or extra:
            raise TrunkMismatchError(
                f"tensor {'missing from' if missing else 'not in the base, found in'} "
                f"the variant ({len(missing)} missing, {len(extra)} extra)",
                head=name, file=str(src), tensor=(missing or extra)[0])
        cfg = _config(Path(src))
        key = next((k for k in sorted((set(base_cfg) | set(cfg)) - _INFO_KEYS)
                    if base_cfg.get(k) != cfg.get(k)), None)
        if key is not None:
            what = "quantization" if key == "quantization" else "configuration"
            raise HeadMismatchError(
                f"{what} differs from the base's (config.json key {key!r}: "
                f"{base_cfg.get(key)!r} vs {cfg.get(key)!r})", head=name, file=str(src))
        for n in head_names:
            a, b = base_ck[n], ck[n]
            if a.dtype != b.dtype or a.shape != b.shape:
                raise HeadMismatchError(
                    f"dtype/shape {b.dtype}{list(b.shape)} differs from the base's "
                    f"{a.dtype}{list(a.shape)} (quantization bits or group size, or dtype)",
                    head=name, file=b.file, tensor=n)
        diff = _first_difference(base_ck, ck, trunk_names)
        if diff is not None:
            raise TrunkMismatchError(
                "trunk tensor differs from the base's (every tensor outside the last "
                f"{tail} layers, the final norm and lm_head must be byte-identical)",
                head=name, file=ck[diff].file, tensor=diff)
        variants[name] = ck

    check_destination(out_p, sources=[base_p, *map(Path, heads.values())], directory=True,
                      overwrite=overwrite, owned=is_bundle)
    out_p.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out_p)
    tmp = tmp_sibling(out_p, "tmp")
    remove(tmp)
    try:
        tmp.mkdir()
        (tmp / HEADS_DIR).mkdir()
        directory: dict[str, Any] = {
            "version": FORMAT_VERSION, "tail": tail, "layers": layers, "align": align,
            "quantization": base_cfg.get("quantization"), "heads": {}}
        result = BuildResult(str(out_p), tail, layers, len(trunk_names),
                             sum(base_ck[n].nbytes for n in trunk_names))
        for name, ck in variants.items():
            rel = f"{HEADS_DIR}/{name}.safetensors"
            write_aligned_file(ck, ck.files[0], tmp / rel, align, 0,
                        extra_metadata={META_HEAD: name}, names=head_names)
            written = Checkpoint(tmp / rel)
            metas = [written[n] for n in head_names]
            crcs = _crc_file(str(tmp / rel), metas)
            directory["heads"][name] = {
                "file": rel, "source": os.path.abspath(os.fspath(heads[name])),
                "bytes": sum(t.nbytes for t in metas),
                "tensors": {t.name: {"dtype": t.dtype, "shape": list(t.shape),
                                     "crc32": crcs[t.name]} for t in metas}}
            result.heads[name] = directory["heads"][name]["bytes"]
            fault_point(f"wrote {tmp / rel}")
        write_aligned_file(base_ck, base_ck.files[0], tmp / TRUNK_FILE, align, 0,
                    extra_metadata={META_HEADS: json.dumps(directory, separators=(",", ":"))},
                    names=trunk_names)
        for entry in sorted((base_p if base_p.is_dir() else base_p.parent).iterdir()):
            if (entry.is_file() and entry.suffix != ".safetensors"
                    and entry.name != "model.safetensors.index.json"):
                shutil.copy2(entry, tmp / entry.name)
        fault_point(f"wrote {tmp}")
        commit(tmp, out_p, overwrite)
    except BaseException as exc:
        remove(tmp)
        raise renamed_error(exc, tmp, out_p) from None
    return result


def is_bundle(path: str | os.PathLike[str]) -> bool:
    """``path`` is a head bundle directory (cheap: two stat calls)."""
    p = Path(path)
    return (p / TRUNK_FILE).is_file() and (p / HEADS_DIR).is_dir()


class Bundle:
    """A head bundle's trunk checkpoint and directory of heads."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        trunk_file = self.path / TRUNK_FILE
        self.trunk = Checkpoint(trunk_file)
        raw = self.trunk.metadata().get(META_HEADS)
        if raw is None:
            raise HeadError(f"no {META_HEADS!r} directory in the metadata: not a head bundle",
                            file=str(trunk_file))
        try:
            d = json.loads(raw)
            self.tail = int(d["tail"])
            self.layers = int(d["layers"])
            self.heads: dict[str, dict] = dict(d["heads"])
            self.quantization = d.get("quantization")
            if d.get("version") != FORMAT_VERSION:
                raise ValueError(f"version {d.get('version')!r}, expected {FORMAT_VERSION}")
            for name, e in self.heads.items():
                if not NAME_RE.fullmatch(name) or e["file"] != f"{HEADS_DIR}/{name}.safetensors":
                    raise ValueError(f"bad entry for head {name!r}")
                for t in e["tensors"].values():
                    t["shape"] = tuple(int(x) for x in t["shape"])
                    t["crc32"] = int(t["crc32"])
        except (ValueError, KeyError, TypeError) as exc:
            raise HeadError(f"malformed heads directory in the metadata: {exc}",
                            file=str(trunk_file)) from exc
        if not self.heads:
            raise HeadError("the bundle has no heads", file=str(trunk_file))

    @property
    def names(self) -> list[str]:
        return list(self.heads)

    def entry(self, name: str) -> dict:
        if name not in self.heads:
            raise UnknownHeadError(f"no such head; the bundle has {self.names}", head=name)
        return self.heads[name]

    def head_file(self, name: str) -> Path:
        return self.path / self.entry(name)["file"]

    def head_tensors(self) -> list[str]:
        """Tensor names every head holds (the same for all heads)."""
        return list(next(iter(self.heads.values()))["tensors"])
