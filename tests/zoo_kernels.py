"""One architecture of mlx-lm's model zoo computed with pyloader's CPU kernels
(``kernels="auto"``, load_model's default) against MLX's own ops (``kernels="mlx"``) and
the float64 reference (the child of tests/test_zoo.py's kernels tests; one process per
architecture).

    python tests/zoo_kernels.py ARCH DIR      # prints one JSON line: the outcome
    python tests/zoo_kernels.py --summary LOG # the table of a sweep's outcomes

The tiny float32 model of tests/zoo.py and a 4-bit copy of it (mlx-lm's
``quantize_model``, groups of 32: every layer whose width allows). For each, the
``kernels="mlx"`` model's greedy continuation of :data:`STEPS` tokens after the prompt is
the teacher: the logits of the prompt and of each of those steps (through the model's
KV cache, one token a step) from ``kernels="mlx"``, ``kernels="auto"`` and the
float64 reference (tests/reference64.py; float32 where the architecture does not compute
in float64, which the outcome names). The measure is docs/kernels.md's: the largest
deviation from the reference over every step, as a fraction of the reference's largest
logit, is at most twice MLX's own plus 1e-5; each pick of ``kernels="auto"`` is the
reference's, except at a near-tie (a margin under twice MLX's own largest deviation);
and no NaN where ``kernels="mlx"`` has none. Outcome ``status``:

* ``within``: every variant within that bound;
* ``beyond`` / ``nan``: a variant past it, or NaN where MLX has none;
* ``unreproducible``: two loads of the model with ``kernels="mlx"`` gave different
  logits, so there is nothing to compare with (a prompt token past the vocabulary reads
  memory past the embedding table: tests/zoo.py's ``prompt_for`` keeps it inside);
* ``failed``: ``kernels="auto"`` raised where ``kernels="mlx"`` ran;
* ``skipped``: plain mlx-lm cannot build or run the architecture from the tiny config.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import zoo

#: Teacher-forced decode steps after the prompt.
STEPS = 16
#: The bound's floor, as a fraction of the logits' scale (docs/kernels.md).
FLOOR = 1e-5


def _teacher_forced(model, prompt: list[int], tokens: list[int]):
    """The last logits after the prompt and after each of ``tokens`` fed one at a time
    through the model's cache: a (1 + len(tokens), vocab) float64 array."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = [model(mx.array([prompt]), cache=cache)[0, -1]]
    for t in tokens:
        rows.append(model(mx.array([[t]]), cache=cache)[0, -1])
    out = mx.stack(rows)
    return np.array(out if out.dtype == mx.float64 else out.astype(mx.float32), np.float64)


def _greedy(model, prompt: list[int]) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=STEPS)]


def _quantized_copy(path: Path) -> Path:
    """A 4-bit copy of the checkpoint at ``path`` (groups of 32), beside it."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(path, lazy=False)
    if config.get("quantization", 0) is None:  # a null entry reads as "quantized" to mlx-lm
        del config["quantization"]
    model, config = quantize_model(model, config, 32, 4)
    out = path.with_name(path.name + "-q4")
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def _reference(path: Path, prompt: list[int], tokens: list[int]):
    """The reference's logits and its dtype's name: float64, else float32 (an op
    without float64 on the CPU), else None when neither builds."""
    import mlx.core as mx
    from reference64 import float64_reference

    for dtype, name in ((mx.float64, "float64"), (mx.float32, "float32")):
        try:
            return _teacher_forced(float64_reference(path, dtype), prompt, tokens), name
        except Exception:  # noqa: BLE001, S112 - the next dtype
            continue
        finally:
            _release()
    return None, None


def _release() -> None:
    """Frees the models just deleted, MLX's cached buffers included: the largest of
    mlx-lm's test configs (gpt_oss: 1.7 GB in float32) holds one model at a time within
    the process's address-space limit."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


def _arch_class(model) -> str:
    """``moe``, ``recurrent`` (a cache that is not only keys and values: linear
    attention, state-space or hybrid layers) or ``attention``."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    if zoo._is_moe(model):
        return "moe"
    caches = make_prompt_cache(model)
    plain = all(isinstance(c, (KVCache, RotatingKVCache)) for c in caches)
    return "attention" if plain else "recurrent"


def measure(l_auto, l_mlx, l_ref) -> dict:
    """docs/kernels.md's measure of ``kernels="auto"``'s logits (see the module doc)."""
    import numpy as np

    mlx_finite = np.isfinite(l_mlx)
    nan = bool((~np.isfinite(l_auto) & mlx_finite).any())
    ok = mlx_finite & np.isfinite(l_ref)
    # (Logits all 0, as a tiny model with a zero output layer gives: any deviation
    # counts in full.)
    scale = float(np.abs(l_ref[ok]).max()) if ok.any() else 0.0
    scale = scale or float(np.finfo(np.float32).tiny)
    dev_mlx = float(np.abs(l_mlx - l_ref)[ok].max()) if ok.any() else 0.0
    both = ok & np.isfinite(l_auto)
    dev_auto = float(np.abs(l_auto - l_ref)[both].max()) if both.any() else 0.0
    flips = []
    for step, (a, r) in enumerate(zip(l_auto, l_ref)):
        pick, ours = int(np.argmax(r)), int(np.argmax(a))
        if ours != pick:
            margin = float(r[pick] - r[ours])
            if not margin < 2 * dev_mlx:
                flips.append({"step": step, "margin": margin / scale})
    return {"dev_auto": dev_auto / scale, "dev_mlx": dev_mlx / scale,
            "dev_auto_vs_mlx": float(np.abs(l_auto - l_mlx)[both].max()) / scale
            if both.any() else 0.0,
            "bound": 2 * dev_mlx / scale + FLOOR, "nan": nan, "flips": flips}


def _variant(path: Path) -> dict:
    """One checkpoint's outcome (``kernels`` says what ``kernels="auto"`` replaced)."""
    import numpy as np

    import pyloader

    plain, _ = pyloader.load_model(path, kernels="mlx", tokenizer=False)
    prompt = zoo.prompt_for(plain)
    tokens = _greedy(plain, prompt)
    l_mlx = _teacher_forced(plain, prompt, tokens)
    arch_class = _arch_class(plain)
    del plain
    _release()
    again, _ = pyloader.load_model(path, kernels="mlx", tokenizer=False)
    l_again = _teacher_forced(again, prompt, tokens)
    del again
    _release()
    print("ZOO-REFERENCE-RAN", flush=True)  # from here on an error is pyloader's
    if not np.array_equal(l_mlx, l_again, equal_nan=True):
        moved = float(np.nanmax(np.abs(l_mlx - l_again)) / np.nanmax(np.abs(l_mlx)))
        return {"status": "unreproducible", "class": arch_class,
                "reason": f'two loads with kernels="mlx" differ by {moved:.3g} of the '
                          "logits' scale: no reference"}
    try:
        fast, _ = pyloader.load_model(path, kernels="auto", tokenizer=False)
        report = pyloader.kernels.install(fast, "auto")
        l_auto = _teacher_forced(fast, prompt, tokens)
    except Exception as e:  # noqa: BLE001 - recorded
        return {"status": "failed", "reason": f"{type(e).__name__}: {str(e)[:400]}"}
    del fast
    _release()
    l_ref, ref_dtype = _reference(path, prompt, tokens)
    if l_ref is None:  # MLX's own logits, so the bound is the floor alone
        l_ref, ref_dtype = l_mlx, "kernels=mlx"
    out = {"class": arch_class, "reference": ref_dtype, **measure(l_auto, l_mlx, l_ref),
           "kernels": {"replaced": len(report.replaced), "kept": len(report.kept),
                       "elementwise": len(report.elementwise),
                       "attention": bool(report.attention), "swiglu": bool(report.swiglu)}}
    out["status"] = ("nan" if out["nan"] else
                     "beyond" if out["dev_auto"] > out["bound"] or out["flips"] else "within")
    return out


def run(arch: str, root: Path) -> dict:
    """The outcome of ``arch`` (see the module doc)."""
    path = root / arch

    def skipped(e: BaseException) -> dict:
        return {"status": "skipped",
                "reason": f"plain mlx-lm: {type(e).__name__}: {str(e)[:300]}"}

    try:
        source = zoo._build(arch, path)
    except BaseException as e:  # noqa: BLE001 - SystemExit: olmo's import exits
        return {"arch": arch, "sweep": "kernels", **skipped(e)}
    out = {"arch": arch, "sweep": "kernels", "config": source, "variants": {}}
    variants = [("float32", lambda: path), ("q4", lambda: _quantized_copy(path))]
    for name, checkpoint in variants:
        try:
            p = checkpoint()
            _release()
            out["variants"][name] = _variant(p)
        except BaseException as e:  # noqa: BLE001 - plain mlx-lm's own steps failed
            out["variants"][name] = skipped(e)
    states = [v["status"] for v in out["variants"].values()]
    ran = [s for s in states if s != "skipped"]
    out["status"] = next((s for s in ("failed", "nan", "unreproducible", "beyond")
                          if s in ran),
                         "within" if ran else "skipped")
    if not ran:
        out["reason"] = "; ".join(v["reason"] for v in out["variants"].values())
    return out


def summary(lines) -> str:
    """The markdown table of a sweep's outcomes (the ``ZOO`` lines ``pytest -s -m zoo
    tests/test_zoo.py`` prints): per architecture class and variant, the architectures
    measured and the largest deviations, each as a fraction of the largest logit."""
    rows: dict[tuple[str, str], list[tuple[str, dict]]] = {}
    skipped, failed = [], []
    for line in lines:
        if not line.startswith("ZOO {") or '"sweep": "kernels"' not in line:
            continue
        out = json.loads(line[4:line.rfind("}") + 1])
        if "variants" not in out:
            (skipped if out["status"] == "skipped" else failed).append(out["arch"])
            continue
        if out["status"] not in ("within", "skipped"):
            failed.append(out["arch"])
        for name, v in out["variants"].items():
            if v["status"] == "skipped":
                skipped.append(f"{out['arch']} ({name})")
            else:
                rows.setdefault((v.get("class", "?"), name), []).append((out["arch"], v))
    text = [("| class | variant | architectures | largest deviation from float64 "
             "(kernels=\"auto\") | MLX's own (kernels=\"mlx\") | largest auto vs mlx | NaN "
             "where MLX has none | past the bound |"), "|---|---|---|---|---|---|---|---|"]

    def top(vs, key):
        arch, v = max(vs, key=lambda av: av[1][key])
        return f"{v[key]:.2g} ({arch})"

    for (cls, name), vs in sorted(rows.items()):
        text.append(f"| {cls} | {name} | {len(vs)} | {top(vs, 'dev_auto')} | "
                    f"{top(vs, 'dev_mlx')} | {top(vs, 'dev_auto_vs_mlx')} | "
                    f"{sum(v['nan'] for _, v in vs)} | "
                    f"{sum(v['status'] == 'beyond' for _, v in vs)} |")
    text.append("")
    text.append(f"Not measured (plain mlx-lm cannot build, quantize or run them from the tiny "
                f"config): {', '.join(sorted(set(skipped))) or 'none'}. Failed: "
                f"{', '.join(failed) or 'none'}.")
    return "\n".join(text)


if __name__ == "__main__":
    import resource

    if sys.argv[1] == "--summary":
        print(summary(Path(sys.argv[2]).read_text().splitlines()))
        sys.exit(0)
    resource.setrlimit(resource.RLIMIT_AS, (zoo.ADDRESS_SPACE, zoo.ADDRESS_SPACE))
    arch, root = sys.argv[1], Path(sys.argv[2])
    try:
        result = run(arch, root)
    except BaseException:  # noqa: BLE001
        result = {"arch": arch, "sweep": "kernels", "status": "failed",
                  "reason": traceback.format_exc()[-800:]}
    print("ZOO " + json.dumps(result), flush=True)
