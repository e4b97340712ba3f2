"""With several processes, delayed scaling uses the amax over all of them (as Transformer Engine
does), so every rank keeps the scales one process would have."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from readback.numerics import E4M3, DelayedScaling
from readback.numerics.state import Numerics
from specs import make_spec

pytestmark = pytest.mark.distributed  # process groups on local ports: one such module at a time


def _rank(rank: int, world: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        numerics = Numerics(make_spec("fp8", DelayedScaling(amax_history_len=4)))
        numerics.site("x").quantize(torch.full((8,), 2.0 + 6.0 * rank))  # amax 2 on rank 0, 8 on rank 1
        numerics.end_step()
        out[rank] = float(numerics.site("x").state.scale)
    finally:
        dist.destroy_process_group()


def test_delayed_scaling_amax_is_reduced_over_ranks():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(2, port, out), nprocs=2, join=True)
    assert out[0] == out[1] == E4M3.max / 8.0
