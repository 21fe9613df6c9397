"""What is in a checkpoint, from its headers only: ``pyloader inspect``.

Every format rule is checked (:class:`pyloader.FormatError` naming the file, tensor and rule).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import struct
from collections import defaultdict

from .._native import core
from .._util.fs import is_regular_file
from .._util.names import layer_prefix
from ..errors import FormatError
from .checkpoint import ITEMSIZE, Checkpoint, refuse_gguf
from .hub import resolve


def _config(path: str) -> dict | None:
    d = path if os.path.isdir(path) else os.path.dirname(path)
    f = os.path.join(d, "config.json")
    if not is_regular_file(f, "config.json"):  # a directory, a loop, ...: said, not skipped
        return None
    with open(f) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{f}: not valid JSON ({exc}); fix or remove the file") from exc


def _quantization(tensors: dict, config: dict | None) -> dict:
    """Quantized modules (a ``.scales`` next to a ``.weight``), their bits and group size."""
    qcfg = (config or {}).get("quantization") or (config or {}).get("quantization_config")
    default_group = qcfg.get("group_size") if isinstance(qcfg, dict) else None
    layouts: dict[tuple, dict] = defaultdict(lambda: {"modules": 0, "bytes": 0})
    for name, t in tensors.items():
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        w = tensors.get(module + ".weight")
        if w is None:
            continue
        override = qcfg.get(module) if isinstance(qcfg, dict) else None
        group = (override or {}).get("group_size", default_group) if isinstance(
            override, (dict, type(None))) else default_group
        bits = None
        if group and w.shape and t.shape and t.shape[-1]:
            in_features = t.shape[-1] * group
            packed_bits = w.shape[-1] * ITEMSIZE.get(w.dtype, 4) * 8
            if packed_bits % in_features == 0:
                bits = packed_bits // in_features
        nbytes = w.nbytes + t.nbytes
        b = tensors.get(module + ".biases")
        nbytes += b.nbytes if b is not None else 0
        entry = layouts[(bits, group, w.dtype, t.dtype)]
        entry["modules"] += 1
        entry["bytes"] += nbytes
    return {
        "config": qcfg if isinstance(qcfg, dict) else None,
        "layouts": [{"bits": k[0], "group_size": k[1], "weight_dtype": k[2],
                     "scales_dtype": k[3], **v} for k, v in sorted(
                         layouts.items(), key=lambda kv: -kv[1]["bytes"])],
    }


#: What a file that is not a safetensors file may be instead, by its first bytes.
_MAGIC = {b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"PK\x03\x04": "a zip "
          "archive (a PyTorch checkpoint?)", b"\x80": "a pickle (a PyTorch checkpoint?)",
          b"{": "JSON text"}

RULE = ("a safetensors file starts with its header's length (8 bytes, little-endian), "
        "then that many bytes of JSON object, then the tensor data")


def check_looks_like_safetensors(path: str | os.PathLike[str]) -> None:
    """A first look at ``path`` before its headers are parsed, for clear messages.

    Raises:
        FileNotFoundError: a directory with no ``*.safetensors`` file and no index.
        pyloader.FormatError: not a safetensors file (:class:`pyloader.GGUFFileError` for GGUF).
    """
    path = os.fspath(path)
    refuse_gguf(path)
    if os.path.isdir(path):
        if not glob.glob(os.path.join(glob.escape(path), "*.safetensors")) and \
                not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
            raise FileNotFoundError(
                errno.ENOENT, "no checkpoint here: the directory holds no *.safetensors "
                "file and no model.safetensors.index.json", path)
        return
    if not os.path.isfile(path):
        return  # the checkpoint's own error names it
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(16)
    if size < 8:
        raise FormatError(f"{path}: not a safetensors file ({size} bytes; {RULE})")
    (n,) = struct.unpack("<Q", head[:8])
    if n <= size - 8 and head[8:9] == b"{":
        return
    what = next((f" It looks like {kind}." for magic, kind in _MAGIC.items()
                 if head.startswith(magic)), "")
    broken = "more than the file holds" if n > size - 8 else "not a JSON object"
    raise FormatError(f"{path}: not a safetensors file: its first 8 bytes give a header of "
                      f"{n} bytes, {broken} ({size} bytes in all); {RULE}.{what}")


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict:
    """A JSON-able summary of the checkpoint at ``path`` (file or model directory).

    Raises:
        pyloader.FormatError: a header breaks a rule of the format.
        OSError: a file cannot be opened or read.
        ValueError: ``config.json`` beside the weights is not valid JSON.
    """
    check_looks_like_safetensors(resolve(path))
    ckpt = Checkpoint(path)
    metas = ckpt.tensors()
    by_name = {t.name: t for t in metas}
    files = [{"path": f.path, "size": f.size, "header_bytes": f.header_bytes,
              "data_start": f.data_start, "tensors": sum(1 for t in metas if t.file == f.path),
              "metadata": ckpt.metadata(f.path)} for f in ckpt.index.files]
    groups: dict[str, dict] = {}
    layers: dict[int, dict] = {}
    for t in metas:
        prefix, layer = layer_prefix(t.name)
        if layer is None:
            g = groups.setdefault(t.name.rsplit(".", 1)[0], {"tensors": 0, "bytes": 0})
        else:
            g = layers.setdefault(layer, {"tensors": 0, "bytes": 0, "prefix": prefix})
        g["tensors"] += 1
        g["bytes"] += t.nbytes

    def share(pred) -> dict:
        sel = [t for t in metas if pred(t)]
        return {"tensors": len(sel), "bytes": sum(t.nbytes for t in sel)}

    dtypes = {d: share(lambda t, d=d: t.dtype == d) for d in dict.fromkeys(t.dtype for t in metas)}
    page = core.page_size()  # the kernel's, or PYLOADER_PAGE_SIZE: what the readers round to
    alignment = {
        "itemsize": share(lambda t: t.aligned or t.nbytes == 0),
        "page": share(lambda t: t.offset % page == 0),
        "misaligned": share(lambda t: not (t.aligned or t.nbytes == 0)),
        "page_size": page,
    }
    config = _config(ckpt.path)
    layer_bytes = [v["bytes"] for _, v in sorted(layers.items())]
    return {
        "path": ckpt.path,
        "files": files,
        "tensors": len(metas),
        "bytes": ckpt.total_nbytes,
        "model_type": (config or {}).get("model_type"),
        "config_layers": (config or {}).get("num_hidden_layers"),
        "layers": {str(k): v for k, v in sorted(layers.items())},
        "layer_bytes_min": min(layer_bytes) if layer_bytes else 0,
        "layer_bytes_max": max(layer_bytes) if layer_bytes else 0,
        "other": dict(sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])),
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: -kv[1]["bytes"])),
        "alignment": alignment,
        "quantization": _quantization(by_name, config),
        "checks": "every safetensors format rule holds (docs/format-rules.md)",
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def format_inspection(info: dict, max_layers: int = 8) -> str:
    """:func:`inspect_checkpoint`'s result as text for a terminal."""
    out = [f"{info['path']}: {info['tensors']} tensors, {_mib(info['bytes'])} in "
           f"{len(info['files'])} file(s)" + (f", model_type {info['model_type']}"
                                               if info["model_type"] else "")]
    for f in info["files"]:
        meta = ", ".join(f"{k}={v}" for k, v in f["metadata"].items())
        out.append(f"  {os.path.basename(f['path'])}: {f['size']} bytes, header "
                   f"{f['header_bytes']} bytes, data at {f['data_start']}, {f['tensors']} "
                   f"tensors" + (f", metadata {meta}" if meta else ""))
    out.append("checks: " + info["checks"])
    layers = info["layers"]
    if layers:
        n = len(layers)
        extra = (f" (config.json says {info['config_layers']})"
                 if info["config_layers"] not in (None, n) else "")
        out.append(f"\nlayers: {n}{extra}, {_mib(info['layer_bytes_min'])} - "
                   f"{_mib(info['layer_bytes_max'])} each")
        items = list(layers.items())
        shown = items if n <= max_layers else items[: max_layers // 2] + items[-max_layers // 2:]
        for i, (k, v) in enumerate(shown):
            if n > max_layers and i == max_layers // 2:
                out.append(f"  ... {n - max_layers} more")
            out.append(f"  {v['prefix']}.{k:<4} {v['tensors']:>4} tensors  {_mib(v['bytes'])}")
    if info["other"]:
        out.append("\nother tensors:")
        for k, v in info["other"].items():
            out.append(f"  {k:<40} {v['tensors']:>4} tensors  {_mib(v['bytes'])}")
    out.append("\ndtypes:")
    for k, v in info["dtypes"].items():
        out.append(f"  {k:<8} {v['tensors']:>5} tensors  {_mib(v['bytes']):>14}  "
                   f"{_pct(v['bytes'], info['bytes'])}")
    a, total = info["alignment"], info["bytes"]
    out.append("\nalignment (zero-copy views need offset % itemsize == 0):")
    out.append(f"  itemsize-aligned  {a['itemsize']['tensors']:>5}/{info['tensors']} tensors  "
               f"{_mib(a['itemsize']['bytes'])} ({_pct(a['itemsize']['bytes'], total)}): "
               "zero-copy with the mmap strategy")
    out.append(f"  page-aligned      {a['page']['tensors']:>5}/{info['tensors']} tensors  "
               f"{_mib(a['page']['bytes'])} ({_pct(a['page']['bytes'], total)}) at "
               f"{a['page_size']}-byte pages")
    if a["misaligned"]["tensors"]:
        out.append(f"  misaligned        {a['misaligned']['tensors']:>5} tensors  "
                   f"{_mib(a['misaligned']['bytes'])}: copied by the mmap strategy unless "
                   "allow_misaligned=True")
    q = info["quantization"]
    if q["layouts"] or q["config"]:
        out.append("\nquantization:")
        if q["config"]:
            overrides = [k for k, v in q["config"].items() if isinstance(v, dict)]
            out.append(f"  config.json: group_size {q['config'].get('group_size')}, bits "
                       f"{q['config'].get('bits')}"
                       + (f", {len(overrides)} per-module overrides" if overrides else ""))
        for lay in q["layouts"]:
            out.append(f"  {lay['modules']:>4} modules  {lay['bits'] or '?'}-bit, group "
                       f"{lay['group_size'] or '?'}, weight {lay['weight_dtype']}, scales "
                       f"{lay['scales_dtype']}  {_mib(lay['bytes'])}")
    else:
        out.append("\nquantization: none")
    return "\n".join(out)


