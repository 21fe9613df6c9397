"""``pyloader.gguf``: the documented path of :mod:`pyloader.io.gguf` (:func:`convert_gguf`)."""

from .io.gguf import (  # noqa: F401 - re-exported
    DTYPES,
    SUPPORTED_ARCHITECTURES,
    __all__,
    convert_gguf,
    permute_qk_rows,
    read_gguf,
    read_tensor_types,
    unpermute_qk_rows,
)
