"""Host measurements and file helpers a harness reads, as public names."""

from .._util.fs import cache_dir, fsync_file, remove
from .._util.host import peak_rss, process_memory
from .._util.names import count_layers, layer_order
from .._util.procfs import NO_PROC_ENV, loadavg, proc_disabled, reset_peak_rss
from .._util.sizes import format_bytes, format_size, parse_amount, parse_bytes

__all__ = ["NO_PROC_ENV", "cache_dir", "count_layers", "format_bytes", "format_size",
           "fsync_file", "layer_order", "loadavg", "parse_amount", "parse_bytes", "peak_rss",
           "proc_disabled", "process_memory", "remove", "reset_peak_rss"]
