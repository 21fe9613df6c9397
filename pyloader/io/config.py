"""A model's ``config.json`` checked before mlx-lm builds anything from it.

mlx-lm builds the model's skeleton straight from the config: ``num_hidden_layers:
100000`` allocates until the process is killed, ``vocab_size: 0`` or ``-5`` and
``num_attention_heads: 0`` end in a bare ``AssertionError`` or ``ZeroDivisionError``.
:func:`check_config` runs first (``pyloader.load_model`` calls it once the checkpoint's
headers are read, before the skeleton) and raises :class:`pyloader.ConfigError` naming
the file and the field:

* the sizes mlx-lm's common architectures read (layers, hidden size, heads, KV heads,
  head size, intermediate sizes, vocabulary, experts) are positive integers,
  in the config and in its ``text_config``;
* attention heads divide the hidden size (unless ``head_dim`` is given) and KV heads
  divide the attention heads; experts per token are at most the experts;
* with ``strict`` (the default: every parameter must come from the checkpoint), the
  config agrees with its own checkpoint: no more decoder layers than the checkpoint's
  tensors hold, and no more parameters than its bytes could hold at 2 bits each with a
  factor 4 of slack (16 parameters per stored byte; an architecture this estimate
  misjudges is still far below it). ``strict=False`` keeps mlx-lm's meaning (missing
  weights keep their initial values), so only the field rules apply.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._util.names import count_layers
from ..errors import ConfigError

#: Fields that must be positive integers wherever they appear.
POSITIVE_FIELDS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers",
    "hidden_size", "n_embd", "d_model", "dim",
    "num_attention_heads", "n_head", "n_heads",
    "num_key_value_heads", "n_kv_heads",
    "head_dim",
    "intermediate_size", "moe_intermediate_size", "ffn_dim",
    "vocab_size",
    "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
)
#: Fields mlx-lm architectures default to 0 for "not set" (ernie4_5_moe's
#: ``moe_intermediate_size`` then falls back to ``intermediate_size``; qwen3_5's dense
#: variant has ``num_experts`` 0): 0 is allowed there, a negative value never.
ZERO_MEANS_UNSET = frozenset({"moe_intermediate_size", "num_experts", "num_local_experts",
                              "n_routed_experts", "num_experts_per_tok"})
#: The checkpoint must hold at least one bit in 2 for every parameter the config implies.
MIN_BITS_PER_PARAMETER = 2


def _sections(config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [("", config)]
    for key in ("text_config", "language_config", "llm_config"):
        sub = config.get(key)
        if isinstance(sub, dict):
            out.append((f"{key}.", sub))
    return out


def _int_field(cfg: dict, name: str) -> int | None:
    v = cfg.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def check_config(path: str | os.PathLike[str], checkpoint=None, *,
                 model_config: dict[str, Any] | None = None, strict: bool = True) -> None:
    """Check the config of the model directory ``path`` (with ``model_config``'s
    overrides, as ``load_model`` applies them) before a skeleton is built from it.

    Args:
        path: The model directory (its ``config.json``).
        checkpoint: Its :class:`pyloader.Checkpoint`, for the size checks (None: only
            the field rules).
        model_config: Entries overriding the file's.
        strict: The checkpoint must hold every layer and (roughly) every parameter the
            config declares.

    Raises:
        pyloader.ConfigError: the first rule broken, naming the file and the field.
    """
    file = str(Path(path) / "config.json")
    try:
        config = json.loads(Path(file).read_text())
    except FileNotFoundError:
        return  # mlx-lm's own error names the missing file
    except ValueError as exc:
        raise ConfigError(f"not valid JSON: {exc}", file=file) from None
    if not isinstance(config, dict):
        raise ConfigError("must be a JSON object", file=file)
    config = {**config, **(model_config or {})}
    for prefix, cfg in _sections(config):
        _check_fields(cfg, prefix, file)
    if checkpoint is not None:
        _check_against_checkpoint(config, checkpoint, file, strict)


def _check_fields(cfg: dict, prefix: str, file: str) -> None:
    for name in POSITIVE_FIELDS:
        if name not in cfg or cfg[name] is None:
            continue
        v = cfg[name]
        if _int_field(cfg, name) is None or v < 0 or (v == 0 and name not in ZERO_MEANS_UNSET):
            rule = ("a non-negative integer (0: not set)" if name in ZERO_MEANS_UNSET
                    else "a positive integer")
            raise ConfigError(f"must be {rule}, got {v!r}", file=file, field=prefix + name)
    hidden = _int_field(cfg, "hidden_size")
    heads = _int_field(cfg, "num_attention_heads")
    kv = _int_field(cfg, "num_key_value_heads")
    if hidden and heads and _int_field(cfg, "head_dim") is None and hidden % heads:
        raise ConfigError(f"{heads} attention heads do not divide hidden_size {hidden} (and "
                          "no head_dim is given)", file=file, field=prefix + "num_attention_heads")
    if heads and kv and heads % kv:
        raise ConfigError(f"{kv} key/value heads do not divide the {heads} attention heads",
                          file=file, field=prefix + "num_key_value_heads")
    per_token = _int_field(cfg, "num_experts_per_tok")
    experts = next((_int_field(cfg, k) for k in ("num_experts", "num_local_experts",
                                                  "n_routed_experts")
                    if _int_field(cfg, k)), None)
    if per_token and experts and per_token > experts:
        raise ConfigError(f"{per_token} experts per token but only {experts} experts",
                          file=file, field=prefix + "num_experts_per_tok")


def estimated_parameters(cfg: dict[str, Any]) -> int:
    """A rough count of the parameters a decoder config describes (attention, MLP or
    experts, embeddings); 0 when the config does not give the sizes."""
    layers = _int_field(cfg, "num_hidden_layers") or 0
    hidden = _int_field(cfg, "hidden_size") or 0
    if not layers or not hidden:
        return 0
    heads = _int_field(cfg, "num_attention_heads") or 1
    kv = _int_field(cfg, "num_key_value_heads") or heads
    head_dim = _int_field(cfg, "head_dim") or max(1, hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    experts = next((_int_field(cfg, k) for k in ("num_experts", "num_local_experts",
                                                  "n_routed_experts")
                    if _int_field(cfg, k)), None)
    inner = (_int_field(cfg, "moe_intermediate_size") if experts else None) or \
        _int_field(cfg, "intermediate_size") or 0
    mlp = 3 * hidden * inner * (experts or 1)
    vocab = _int_field(cfg, "vocab_size") or 0
    return layers * (attention + mlp) + vocab * hidden


def _check_against_checkpoint(config: dict, checkpoint, file: str, strict: bool) -> None:
    if not strict:  # mlx-lm keeps initial values for what the checkpoint lacks
        return
    stored_layers = count_layers(checkpoint.keys())
    stored_bytes = checkpoint.total_nbytes
    for prefix, cfg in _sections(config):
        layers = _int_field(cfg, "num_hidden_layers")
        if layers and stored_layers and layers > stored_layers:
            raise ConfigError(
                f"{layers} layers, but the checkpoint's tensors hold {stored_layers}: the "
                "config does not describe this checkpoint", file=file,
                field=prefix + "num_hidden_layers")
        params = estimated_parameters(cfg)
        # at MIN_BITS_PER_PARAMETER bits each, with a factor 4 of slack for what the
        # estimate misjudges (tied or shared weights, unusual blocks)
        if stored_bytes and params * MIN_BITS_PER_PARAMETER > 4 * 8 * stored_bytes:
            raise ConfigError(
                f"describes about {params:,} parameters, far more than the checkpoint's "
                f"{stored_bytes:,} bytes could hold: the config does not describe this "
                "checkpoint", file=file, field=prefix + "num_hidden_layers")


__all__ = ["POSITIVE_FIELDS", "check_config", "estimated_parameters"]
