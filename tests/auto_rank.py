"""One rank of the ``resident="auto"`` loopback test (run by mlx.launch, see
test_auto_budget.py).

``python auto_rank.py MODEL OUT TOKENS CLAMP0 CLAMP1 SHORT``: ``MODEL`` with ``{rank}``
replaced by the rank (each rank reads its own copy). Rank r clamps its headroom to
``CLAMPr`` bytes for its ``"auto"`` loads (``PYLOADER_HEADROOM``; ``-``: unclamped). For each of
``shard="pipeline"`` and ``"tensor"`` the rank loads with ``resident="auto"`` and with a
fixed setting (mlx-lm's even split, every layer resident; pipeline also with
``resident=[1.0, 0.25]``), keeps the prompt's last logits and ``TOKENS`` greedy tokens
of each, then clamps rank 1 to ``SHORT`` bytes and records the ``MemoryError``
of another ``resident="auto"`` load. Writes ``OUT/rank{rank}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from tp_rank import greedy, last_logits

import pyloader
from pyloader._util.memory import HEADROOM_ENV
from pyloader.distributed import rank_stats


def clamp(value: str) -> None:
    if value == "-":
        os.environ.pop(HEADROOM_ENV, None)
    else:
        os.environ[HEADROOM_ENV] = value


def main() -> None:
    template, out, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    clamps, short = sys.argv[4:6], sys.argv[6]
    group = mx.distributed.init(strict=True)
    rank = group.rank()
    path = Path(template.replace("{rank}", str(rank)))
    result: dict = {"rank": rank}
    for shard in ("pipeline", "tensor"):
        runs = {}
        settings = [("auto", "auto"), ("fixed", 1.0)]
        if shard == "pipeline":  # each rank its own: rank 1 streams its last layers
            settings.append(("mixed", [1.0, 0.25]))
        for name, resident in settings:
            clamp(clamps[rank] if resident == "auto" else "-")
            model, _ = pyloader.load_model(path, group=pyloader.Distribution(group, shard=shard),
                                           resident=resident, tokenizer=False,
                                           options=pyloader.StreamOptions(strategy="pread"))
            st = rank_stats(model)
            st.pop("units", None)
            runs[name] = {"logits": last_logits(model), "tokens": greedy(model, n),
                          "stats": st}
            del model
        clamp(short if rank == 1 else clamps[rank])
        try:
            pyloader.load_model(path, group=pyloader.Distribution(group, shard=shard),
                                resident="auto", tokenizer=False)
            runs["short"] = None
        except MemoryError as e:
            runs["short"] = str(e)
        result[shard] = runs
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))


if __name__ == "__main__":
    main()
