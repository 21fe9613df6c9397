"""A model's ``config.json`` checked before mlx-lm builds anything from it.

:func:`check_config` raises :class:`pyloader.ConfigError` naming the file and the field: sizes,
head divisibility, bounds, agreement with the checkpoint (``strict``), a ``model_file`` inside
the model directory, and regular files only. See docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from .._util.fs import describe_path, path_error
from .._util.names import count_layers
from ..errors import ConfigError
from .files import open_unblocked

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
#: Fields mlx-lm architectures default to 0 for "not set": 0 is allowed, a negative value never.
ZERO_MEANS_UNSET = frozenset({"moe_intermediate_size", "num_experts", "num_local_experts",
                              "n_routed_experts", "num_experts_per_tok"})
#: The checkpoint must hold at least one bit in 2 for every parameter the config implies.
MIN_BITS_PER_PARAMETER = 2
#: The layer-count fields.
LAYER_FIELDS = frozenset({"num_hidden_layers", "n_layer", "n_layers", "num_layers"})
#: At most this many decoder layers, whatever ``strict`` is (mlx-lm builds every layer's
#: modules before anything is read).
MAX_LAYERS = 1024
#: Any other size at most this (MLX's array dimensions are 32-bit).
MAX_DIMENSION = 2**31 - 1
#: At most this many parameters, whatever ``strict`` is.
MAX_PARAMETERS = 2**42
#: Files beside ``config.json`` mlx-lm or the tokenizer open; each must be a regular file.
SIDE_FILES = ("generation_config.json", "hf_quant_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "tokenizer.model", "vocab.json", "merges.txt", "chat_template.json",
              "chat_template.jinja")


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


def _experts(cfg: dict) -> int | None:
    return next(filter(None, (_int_field(cfg, k) for k in ("num_experts", "num_local_experts",
                                                          "n_routed_experts"))), None)


def check_config(path: str | os.PathLike[str], checkpoint=None, *,
                 model_config: dict[str, Any] | None = None, strict: bool = True) -> None:
    """Check the config of the model directory ``path`` before a skeleton is built from it.

    Args:
        path: The model directory (its ``config.json``).
        checkpoint: Its :class:`pyloader.Checkpoint` for the size checks (None: skip them).
        model_config: Entries overriding the file's.
        strict: The checkpoint must hold every layer and (roughly) every declared parameter.

    Raises:
        pyloader.ConfigError: the first rule broken, naming the file and the field.
    """
    directory = Path(path)
    file = str(directory / "config.json")
    try:
        config = read_config_file(file)
    except FileNotFoundError:
        if os.path.islink(file):
            raise  # a link to nothing: said by read_config_file
        return  # mlx-lm's own error names the missing file
    for name in SIDE_FILES:
        _check_regular(directory / name)
    check_config_values({**config, **(model_config or {})}, file, checkpoint,
                        strict=strict, model_dir=directory)


def read_config_file(file: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in ``file``; :class:`pyloader.ConfigError` unless it is a regular file (a
    FIFO is refused, never blocks) holding valid JSON."""
    file = os.fspath(file)
    try:
        f = open_unblocked(file)
    except FileNotFoundError:
        if not os.path.islink(file):
            raise
        raise path_error(file, "config.json") from None
    except IsADirectoryError:
        raise ConfigError("must be a regular file, not a directory", file=file) from None
    except (OSError, ValueError):  # a loop, a path through a file: say which
        raise path_error(file, "config.json") from None
    with f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ConfigError(f"must be a regular file, not {describe_path(file)[0]}",
                              file=file)
        data = f.read()
    try:
        config = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"not valid JSON: {exc}", file=file) from None
    if not isinstance(config, dict):
        raise ConfigError("must be a JSON object", file=file)
    return config


def _check_regular(file: Path) -> None:
    """ConfigError when ``file`` exists and is not a regular file (never opens it)."""
    try:
        mode = os.stat(file).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if os.path.islink(file):  # a link to nothing: mlx-lm would fail opening it
            raise path_error(file, file.name) from None
        return
    except OSError:
        raise path_error(file, file.name) from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"must be a regular file, not {describe_path(file)[0]}",
                          file=str(file))


def check_config_values(config: dict[str, Any], file: str | None, checkpoint=None, *,
                        strict: bool = True, model_dir: str | os.PathLike[str] | None = None
                        ) -> None:
    """:func:`check_config`'s rules for a config already read (``file`` names it in errors)."""
    for prefix, cfg in _sections(config):
        _check_fields(cfg, prefix, file)
        _check_bounds(cfg, prefix, file)
    if model_dir is not None:
        _check_model_file(config, Path(model_dir), file)
    if checkpoint is not None:
        _check_against_checkpoint(config, checkpoint, file, strict)


def _check_bounds(cfg: dict, prefix: str, file: str | None) -> None:
    for name in POSITIVE_FIELDS:
        v = _int_field(cfg, name)
        bound = MAX_LAYERS if name in LAYER_FIELDS else MAX_DIMENSION
        if v is not None and v > bound:
            raise ConfigError(f"{v:,} is above the largest value pyloader builds a model "
                              f"for ({bound:,})", file=file, field=prefix + name)
    params = estimated_parameters(cfg)
    if params > MAX_PARAMETERS:
        raise ConfigError(f"describes about {params:,} parameters, above the largest model "
                          f"pyloader builds ({MAX_PARAMETERS:,})", file=file,
                          field=prefix + "num_hidden_layers")


def _check_model_file(config: dict, model_dir: Path, file: str | None) -> None:
    """``model_file`` must stay inside the model directory: no absolute path, no ``..``, no
    directory link leading out (a link as the file itself is allowed)."""
    if "model_file" not in config or config["model_file"] is None:
        return
    value = config["model_file"]
    rule = "must be a relative path to a file inside the model directory"
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{rule}, got {value!r}", file=file, field="model_file")
    rel = os.path.normpath(value)
    if os.path.isabs(value) or rel == ".." or rel.startswith(".." + os.sep):
        raise ConfigError(f"{rule}, got {value!r}", file=file, field="model_file")
    root = os.path.realpath(model_dir)
    parent = os.path.realpath(os.path.join(model_dir, os.path.dirname(rel)))
    if os.path.commonpath([root, parent]) != root:
        raise ConfigError(f"{rule}, got {value!r} (a directory on the way leads to "
                          f"{parent})", file=file, field="model_file")


def _check_fields(cfg: dict, prefix: str, file: str | None) -> None:
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
    experts = _experts(cfg)
    if per_token and experts and per_token > experts:
        raise ConfigError(f"{per_token} experts per token but only {experts} experts",
                          file=file, field=prefix + "num_experts_per_tok")


def estimated_parameters(cfg: dict[str, Any]) -> int:
    """A rough parameter count of a decoder config; 0 when the config lacks the sizes."""
    layers = _int_field(cfg, "num_hidden_layers") or 0
    hidden = _int_field(cfg, "hidden_size") or 0
    if not layers or not hidden:
        return 0
    heads = _int_field(cfg, "num_attention_heads") or 1
    kv = _int_field(cfg, "num_key_value_heads") or heads
    head_dim = _int_field(cfg, "head_dim") or max(1, hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    experts = _experts(cfg)
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


