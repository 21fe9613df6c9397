"""Task heads over a resident trunk: bundles, hot swap, preload.

Fine-tuned variants of one base model often differ only in their last layers.
:func:`build` stores the shared trunk once and each variant's head separately
(:mod:`.bundle`: the format); ``pyloader.load_model(bundle_dir, head="chat")`` returns the
mlx-lm model with ``swap_head``, ``preload_heads``, ``auto_preload_heads``,
``release_preloaded_heads``, ``head_usage``, ``current_head``, ``head_names`` and
``preloaded_heads`` (:mod:`.manager`). The errors are those of :mod:`pyloader.errors`.
"""

from ..errors import (
    HeadChecksumError,
    HeadError,
    HeadIOError,
    HeadMismatchError,
    TrunkMismatchError,
    UnknownHeadError,
)
from .bundle import (
    FORMAT_VERSION,
    HEADS_DIR,
    META_HEAD,
    META_HEADS,
    TRUNK_FILE,
    BuildResult,
    Bundle,
    build,
    is_bundle,
    is_head_tensor,
    num_layers,
)
from .manager import BundleLoad, Head, HeadManager, HeadMethods, HeadUsage, SwapStats, manager_of

__all__ = [
    "Bundle",
    "BuildResult",
    "BundleLoad",
    "FORMAT_VERSION",
    "HEADS_DIR",
    "Head",
    "HeadChecksumError",
    "HeadError",
    "HeadIOError",
    "HeadManager",
    "HeadMethods",
    "HeadMismatchError",
    "HeadUsage",
    "META_HEAD",
    "META_HEADS",
    "SwapStats",
    "TRUNK_FILE",
    "TrunkMismatchError",
    "UnknownHeadError",
    "build",
    "is_bundle",
    "is_head_tensor",
    "manager_of",
    "num_layers",
]
