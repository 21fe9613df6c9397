"""Every exception and warning type pyloader defines (all exported from :mod:`pyloader`)."""

from __future__ import annotations

from ._native import core

FormatError = core.FormatError
FormatError.__module__ = "pyloader"
FormatError.__doc__ = (
    "A safetensors file or model index breaks a rule of the format; the message "
    "names the file, the tensor (when there is one) and the rule.")
UnsupportedError = core.UnsupportedError
UnsupportedError.__module__ = "pyloader"
UnsupportedError.__doc__ = (
    "A checkpoint uses something pyloader cannot hand to MLX (a dtype MLX has no "
    "array type for, such as F4/F6) or a feature this build lacks (io_uring without "
    "liburing); the message names the file, the tensor and what to do instead.")
StandInError = core.StandInError
StandInError.__module__ = "pyloader"
StandInError.__doc__ = (
    "A computation read a parameter whose bytes were not in memory: a streamed "
    "parameter reached while its unit was out (a forward that calls a layer's "
    "submodules directly, reads a layer's weights in its own code, ...). Raised by the "
    "evaluation that would have used it (mx.eval, a token's async_eval), before a "
    "token computed from it is returned; the message names the parameter, its layer "
    "and a setting that serves the model (resident=1.0). A RuntimeError.")


class GGUFFileError(FormatError):
    """A GGUF file given where a safetensors checkpoint belongs."""


class ModelNotFoundError(FileNotFoundError):
    """A model neither local, nor cached, nor downloadable; names repo, revision and cache."""


class DefaultModelMissing(FileNotFoundError):
    """The default model's GGUF is missing; the message says what to run."""


class ConfigError(ValueError):
    """A ``config.json`` value no model can be built from; raised before building the skeleton."""

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None):
        parts = [p for p in (file, f"field {field!r}" if field else None) if p]
        super().__init__(f"{': '.join(parts)}: {message}" if parts else message)
        self.file, self.field = file, field


# Serving (pyloader.serving)


class RequestError(ValueError):
    """``pyloader serve`` refuses a request (HTTP 400): a field out of range, a token id outside the
    vocabulary, a prompt longer than the context, a model other than the served one."""


class RequestCancelled(Exception):
    """``pyloader serve``: the client of a request went away; its generation stopped."""


# Head bundles (pyloader.heads)


class HeadError(Exception):
    """A head cannot be built or swapped in; the model keeps its previous head."""

    def __init__(self, message: str, *, head: str | None = None, file: str | None = None,
                 tensor: str | None = None):
        parts = [p for p in (f"head {head!r}" if head else None, file,
                             f"tensor {tensor!r}" if tensor else None) if p]
        super().__init__(f"{': '.join(parts)}: {message}" if parts else message)
        self.head, self.file, self.tensor = head, file, tensor


class UnknownHeadError(HeadError, KeyError):
    """The bundle has no head of that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class HeadMismatchError(HeadError, ValueError):
    """A head's tensors do not match the bundle's directory or the model."""


class HeadChecksumError(HeadMismatchError):
    """A head tensor's bytes do not match the CRC-32 stored in the bundle."""


class TrunkMismatchError(HeadError, ValueError):
    """``heads.build``: a variant's trunk differs from the base's."""


class HeadIOError(HeadError, OSError):
    """A head file could not be opened, parsed or read."""


# Streaming (pyloader.streaming)


class ResidencyWarning(UserWarning):
    """A resident set the memory limit cannot hold: with ``strategy="mmap"`` the load succeeds, but
    the kernel re-reads the pages on every forward pass."""


# KV cache (pyloader.kv)


class KVCacheWarning(UserWarning):
    """A KV-cache event worth knowing: arena outgrown, mlock refused, keys in another dtype."""


# Engines (pyloader.engines)


class EngineError(Exception):
    """A model directory its engine cannot build faithfully (never replaced by a smaller model)."""

    def __init__(self, message: str, *, engine: str | None = None,
                 package: str | None = None, model_path: str | None = None):
        super().__init__(message)
        self.engine, self.package, self.model_path = engine, package, model_path


class EngineNotInstalledError(EngineError, ImportError):
    """The engine a model directory needs is not installed; the message names the package."""


# Measuring (pyloader.compare)


class MeasureError(RuntimeError):
    """A measuring child failed; the message carries its error and stderr tail."""


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


