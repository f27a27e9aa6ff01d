"""What the spawned ranks of test_tensor_parallel.py run: a module that imports no model code,
so that each rank starts in a few seconds."""

from __future__ import annotations

import torch

from phasegraph.runtime.errors import RankDivergence


def diverging_rank(rank: int, port: int) -> None:
    """Rank ``rank`` of two: equal checksums pass, unequal ones raise RankDivergence on both."""
    import datetime

    import torch.distributed as dist

    from phasegraph.runtime.tensor_parallel import TensorParallelGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=90))
    group = TensorParallelGroup(rank, 2, "gloo", torch.device("cpu"), 30, "spmd")
    try:
        group.check_same(7, "equal")  # the same everywhere: passes
        try:
            group.check_same(7 + rank, "emitted-token")
        except RankDivergence as exc:
            if "[7, 8]" not in str(exc):
                raise
        else:
            raise AssertionError("diverging checksums were not noticed")
    finally:
        # both ranks meet and leave the group: a rank exiting under a live gloo thread aborts
        group.close()
