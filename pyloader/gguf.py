"""``pyloader.gguf``: the documented path of :mod:`pyloader.io.gguf` (:func:`convert_gguf`)."""

from .io.gguf import (
    DTYPES,
    SUPPORTED_ARCHITECTURES,
    convert_gguf,
    permute_qk_rows,
    read_gguf,
    read_tensor_types,
    unpermute_qk_rows,
)

__all__ = ["DTYPES", "SUPPORTED_ARCHITECTURES", "convert_gguf", "permute_qk_rows", "read_gguf",
           "read_tensor_types", "unpermute_qk_rows"]
