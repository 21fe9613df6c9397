"""Task heads over a resident trunk: bundles, hot swap, preload. See docs/heads-and-repack.md."""

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
