"""Host measurements a harness reads, as public names."""

from .._util.fs import cache_dir
from .._util.host import peak_rss, process_memory
from .._util.names import count_layers
from .._util.procfs import NO_PROC_ENV, loadavg, proc_disabled, reset_peak_rss
from .._util.sizes import parse_amount, parse_bytes

__all__ = ["NO_PROC_ENV", "cache_dir", "count_layers", "loadavg", "parse_amount",
           "parse_bytes", "peak_rss", "proc_disabled", "process_memory", "reset_peak_rss"]
