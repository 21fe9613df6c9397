"""One architecture of mlx-lm's model zoo, streamed by pyloader and compared with plain
mlx-lm (the child of tests/test_zoo.py; one process per architecture, so a crash in one
architecture's MLX code stays its own).

    python tests/zoo.py ARCH DIR      # prints one JSON line: the outcome

A tiny random float32 instance of ``mlx_lm.models.<ARCH>`` is built from, in this order:
mlx-lm's own tiny config for the architecture (its test suite's, captured by
tests/zoo_suite_configs.py into the JSON file ``$PYLOADER_ZOO_CONFIGS``), this project's
(tests/models.py, tests/moe_models.py), or a generic small config (:data:`BASE`,
:data:`OVERRIDES`, and a guess from each remaining required ModelArgs field's name and
type); the outcome's ``config`` says which. It is saved the
way mlx-lm saves a model, and loaded by plain mlx-lm (``mlx_lm.utils.load_model``) and by
``pyloader.load_model`` at resident 0 with mmap and pread (and, for a mixture-of-experts
model, an expert cache of half the experts). Outcome ``status``:

* ``identical``: every pyloader run's first logits and greedy tokens equal mlx-lm's bit
  for bit;
* ``refused``: a pyloader run raised before its first token (``refusals`` says which and
  why), the others identical;
* ``skipped``: plain mlx-lm cannot build, save, load or run the architecture from the
  tiny config here (``reason``);
* ``different`` / ``failed``: a wrong token or logit, or an error after a token was
  returned — what the zoo test exists to catch.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import traceback
from pathlib import Path

#: The generic tiny config (every architecture's ModelArgs takes what it knows).
BASE = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 256, "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "norm_eps": 1e-5,
    "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": False,
    # Mixture-of-experts settings, for the architectures that read them.
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 0, "moe_layer_freq": 1, "decoder_sparse_step": 1,
    "n_group": 1, "topk_group": 1,
}

#: Architecture-specific additions to BASE.
OVERRIDES: dict[str, dict] = {
    "iquestloopcoder": {"loop_window_size": 4},
}

#: Modules of mlx_lm.models that are not architectures.
NOT_MODELS = {"base", "cache", "rope_utils", "switch_layers", "pipeline", "activations",
              "bitlinear_layers", "ssm", "gated_delta", "mla", "layers"}

#: mlx-lm's test configs larger than this (estimated) are full-size defaults, not tiny
#: models: the zoo uses its own config for those architectures.
MAX_SUITE_PARAMETERS = 500_000_000

PROMPT = [1, 7, 42, 9, 100, 3, 250, 17]
N_TOKENS = 4


def architectures() -> list[str]:
    """Every module of mlx_lm.models that is not a helper."""
    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)
                  if m.name not in NOT_MODELS and not m.name.startswith("_"))


def _guess(name: str, annotation, n_layers: int):
    """A small value for a ModelArgs field the generic config lacks, from its name and
    type (the zoo's tiny config is derived, not hand-written per architecture)."""
    text = str(annotation).lower()
    n = name.lower()
    if "bool" in text:
        return False
    if "list" in text or "tuple" in text:
        if "layer_types" in n or "types" in n:
            return ["full_attention"] * n_layers
        return []
    if "dict" in text:
        return {}
    if "float" in text:
        return 1e-5 if "eps" in n else 1.0
    if "int" in text:
        if "layer" in n:
            return n_layers
        if "kv" in n or "key_value" in n:
            return 2
        if "head" in n and "dim" not in n:
            return 4
        if "expert" in n:
            return 8
        if "window" in n or "chunk" in n:
            return 4
        if "dim" in n or "size" in n or "rank" in n:
            return 16
        return 2
    if "str" in text:
        return "silu" if "act" in n else "default"
    return None


def _suite_config(arch: str) -> dict | None:
    """mlx-lm's own test config for ``arch`` (``$PYLOADER_ZOO_CONFIGS``), if any."""
    path = os.environ.get("PYLOADER_ZOO_CONFIGS")
    if not path:
        return None
    return json.loads(Path(path).read_text()).get(arch)


def _config(arch: str, mod) -> tuple[dict, str]:
    """The tiny config of ``arch`` and where it comes from (mlx-lm's own up to
    ``$PYLOADER_ZOO_MAX_SUITE_PARAMETERS``, else :data:`MAX_SUITE_PARAMETERS`)."""
    import dataclasses

    import moe_models  # noqa: F401 - registers the MoE configs in models.ARCHS
    from models import ARCHS, config_of

    from pyloader.io.config import estimated_parameters

    suite = _suite_config(arch)
    limit = int(os.environ.get("PYLOADER_ZOO_MAX_SUITE_PARAMETERS", MAX_SUITE_PARAMETERS))
    if suite is not None:
        size = estimated_parameters(suite.get("text_config") or suite)
        if size <= limit:
            return suite, "mlx-lm tests"
        # Some of mlx-lm's tests build the model with its full-size defaults (cohere:
        # 35B parameters; cohere2, gpt_neox, phi, phi3, qwen: 2-10B) and never evaluate
        # it: not a tiny model, so this project's or a derived config instead.
    if arch in ARCHS:  # this project's hand-written tiny config
        return config_of(arch), "pyloader tests"
    config = {**BASE, **OVERRIDES.get(arch, {}), "model_type": arch}
    args = getattr(mod, "ModelArgs")
    if dataclasses.is_dataclass(args):
        for f in dataclasses.fields(args):
            if (f.name not in config and f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING):
                config[f.name] = _guess(f.name, f.type, config["num_hidden_layers"])
    return config, "derived"


def _build(arch: str, path: Path) -> str:
    """Writes ``arch``'s tiny model to ``path``; returns where its config came from."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    if not (hasattr(mod, "Model") and hasattr(mod, "ModelArgs")):
        raise LookupError("no Model / ModelArgs")
    config, source = _config(arch, mod)
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    return source


def prompt_for(model) -> list[int]:
    """:data:`PROMPT` within ``model``'s vocabulary (the width of its logits): MLX's
    embedding gather does not check its indices, so a token id past the table reads
    whatever memory lies beyond it, and two loads of one model then compute on
    different values (mlx-lm's tiny configs have vocabularies of 32 to 128)."""
    import mlx.core as mx

    width = model(mx.array([[0]])).shape[-1]
    return [t % width for t in PROMPT]


def _run(model, prompt: list[int], tokens: list[int] | None = None) -> tuple[list, list[int]]:
    """First logits and greedy tokens; ``tokens`` receives each token as it comes."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens = [] if tokens is None else tokens
    logits = model(mx.array([prompt]))
    mx.eval(logits)
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=N_TOKENS):
        tokens.append(int(t))
    return logits[0, -1].tolist(), tokens


def _is_moe(model) -> bool:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return any(isinstance(m, (SwitchGLU, SwitchMLP)) for _, m in model.named_modules())


def run(arch: str, root: Path) -> dict:
    """The outcome of ``arch`` (see the module doc)."""
    from mlx_lm.utils import load_model

    path = root / arch
    source = None
    try:
        source = _build(arch, path)
        ref_model, _ = load_model(path)
        prompt = prompt_for(ref_model)
        ref = _run(ref_model, prompt)
        moe = _is_moe(ref_model)
        del ref_model
        print("ZOO-REFERENCE-RAN", flush=True)  # a crash from here on is pyloader's
    except BaseException as e:  # noqa: BLE001 - SystemExit: olmo's import exits
        return {"arch": arch, "status": "skipped", "config": source,
                "reason": f"plain mlx-lm: {type(e).__name__}: {str(e)[:300]}"}
    import pyloader

    runs = {"mmap": pyloader.StreamOptions(strategy="mmap"),
            "pread": pyloader.StreamOptions(strategy="pread")}
    if moe:
        runs["experts"] = pyloader.StreamOptions(strategy="pread", experts=0.5)
    out = {"arch": arch, "config": source, "moe": moe, "runs": {}, "refusals": {},
           "reference": ref}
    for name, options in runs.items():
        returned: list[int] = []
        try:
            model, _ = pyloader.load_model(path, resident=0, tokenizer=False, options=options)
            got = _run(model, prompt, returned)
        except Exception as e:  # noqa: BLE001 - recorded
            why = f"{type(e).__name__}: {str(e)[:400]}"
            if returned:  # an error after a token was returned is no refusal
                out["runs"][name] = "failed"
                out.setdefault("failures", {})[name] = f"after {len(returned)} tokens: {why}"
            else:
                out["refusals"][name] = why
                out["runs"][name] = "refused"
            continue
        out["runs"][name] = "identical" if got == ref else "different"
        if got != ref:
            out.setdefault("diff", {})[name] = {"tokens": got[1], "ref": ref[1]}
    states = set(out["runs"].values())
    out["status"] = ("different" if "different" in states else
                     "failed" if "failed" in states else
                     "refused" if "refused" in states else "identical")
    return out


#: Address space of one architecture's process: a derived config that asks for far more
#: than a tiny model fails here instead of taking a shared machine's memory.
ADDRESS_SPACE = 8 << 30

def reference(arch: str, root: Path) -> dict:
    """Plain mlx-lm's first logits and tokens on the model ``run`` already wrote (a fresh
    process's: tests/test_zoo.py asks for it when pyloader differed, to tell an
    architecture that plain mlx-lm itself does not compute the same way twice)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(root / arch)
    return {"arch": arch, "reference": _run(model, prompt_for(model))}


if __name__ == "__main__":
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    reference_only = sys.argv[1] == "--reference"
    arch, root = sys.argv[1 + reference_only], Path(sys.argv[2 + reference_only])
    try:
        result = reference(arch, root) if reference_only else run(arch, root)
    except BaseException:  # noqa: BLE001
        result = {"arch": arch, "status": "failed", "reason": traceback.format_exc()[-800:]}
    print("ZOO " + json.dumps(result), flush=True)
