"""Loading across the ranks of an MLX distributed run.

``pyloader.load_model(path, group=mx.distributed.init())`` applies mlx-lm's
own pipeline sharding to the model (``model.model.pipeline(group, split)``,
the call ``mlx_lm.utils.sharded_load`` makes), and only then decides what to
read: each rank maps or streams the tensors of its own layers plus the
non-layer ones every stage keeps (embeddings, final norm, head), with its own
resident set and budget. Nothing of another rank's layers is requested from
the reader (``rank_stats(model)`` carries the reader's byte counters to check).

mlx-lm 0.32.2 implements ``pipeline`` on some architectures (qwen2, qwen3_5,
qwen3_moe, qwen3_next, deepseek, glm4_moe, ...) but not on llama or qwen3. For
those two, whose forward pass is "embed, every layer in ``model.layers``,
norm", :func:`shard_model` applies the same protocol as mlx-lm's
``PipelineMixin``: the same split rule (rank 0 runs the last layers), the
rank's first layer receives the hidden state from rank + 1
(``mx.distributed.recv_like``), its last layer sends to rank - 1 and
``all_gather`` hands rank 0's output to every rank, so every rank computes the
same logits.

:func:`propose_split` proposes the layers per rank from per-layer bytes, each
rank's budget, its read bandwidth and compute rate (the input a memory planner
can call); :func:`plan_split` does it for a checkpoint.

``resident="auto"`` sizes every rank from its own memory at load time: each rank's
weight budget is its headroom (the one rule, :func:`pyloader._util.memory.headroom_of`,
page cache counted as used) minus the pre-flight reserve, and :func:`gather_memory`
hands every rank's budget and least need to every rank (one ``all_gather``). A rank
that cannot fit makes every rank raise the same ``MemoryError`` before anything is
read (:func:`check_memory`). With ``shard="pipeline"`` and no ``split``,
``plan_split(path, "auto", group=g)`` chooses the split from the gathered budgets
(identical on every rank); each rank's resident set then follows its own budget
(:meth:`Share.auto_resident`). Under ``shard="tensor"`` every rank runs every layer in
lockstep and must stream the same layers (:func:`check_lockstep`): the budget is the
smallest rank's, applied to each rank's share (its slices and the replicated tensors).

``shard="tensor"`` applies mlx-lm's own tensor parallelism instead
(``model.shard(group)``, the call ``sharded_load(tensor_group=...)`` makes) and
reads only this rank's slice of every sharded tensor. Which slice that is is
learnt from mlx-lm itself, not re-implemented: :func:`trace_shard` gives every
parameter a lazy stand-in whose values are its indices along one axis (a
broadcast: nothing allocated), runs ``shard`` (on the model for axis 0 and on
structural clones for the other axes), and reads back which indices each sharded
parameter kept (materializing one parameter's traced slice at a time). A
parameter kept whole is read whole; a sharded one becomes a slice of its
checkpoint tensor (:meth:`pyloader.io.checkpoint.Checkpoint.with_slices`): a
block of rows is one byte range (a zero-copy view under mmap when aligned), a
block of columns one range per row, read into a fresh buffer. Streaming and
residency per rank work unchanged (units read their slices). Quantized layers
need nothing special: mlx's ``QuantizedAllToShardedLinear`` & co. cut weight,
scales and biases themselves, and each is traced like any other parameter.
"""

from .memory import RankMemory, check_memory, gather_memory, least_need
from .pipeline import StageHook
from .shard import SHARD_MODES, Distribution, shard_model
from .share import Share, check_lockstep
from .split import (
    RankPlan,
    SplitPlan,
    checkpoint_layer_bytes,
    even_split,
    layer_range,
    measure_read_bps,
    plan_split,
    propose_split,
    tensor_layer_bytes,
)
from .stats import rank_stats, slice_stats
from .tensor import ParamSlice, trace_shard

__all__ = [
    "SHARD_MODES",
    "Distribution",
    "ParamSlice",
    "RankMemory",
    "RankPlan",
    "Share",
    "SplitPlan",
    "StageHook",
    "check_lockstep",
    "check_memory",
    "checkpoint_layer_bytes",
    "even_split",
    "gather_memory",
    "layer_range",
    "least_need",
    "measure_read_bps",
    "plan_split",
    "propose_split",
    "rank_stats",
    "shard_model",
    "slice_stats",
    "tensor_layer_bytes",
    "trace_shard",
]
