"""Tensor parallelism of the target over torch.distributed (Megatron-LM, Shoeybi et al. 2019).

Each rank holds a slice of every decoder layer: the merged qkv product by head group and the
merged gate_up product by intermediate block (column parallel), ``o`` and ``down`` by the
matching input columns (row parallel), so a layer needs one all-reduce after ``o`` and one after
``down`` (the slicing: :mod:`phasegraph.runtime.models.fused_decoder`). The embedding, the final
norm and the lm_head are replicated: every rank computes the same logits from the same
all-reduced hidden state, so sampling (counter-based coins, :mod:`phasegraph.kernels.random`)
picks the same tokens on every rank without another collective. Each rank's KV pool holds only its kv heads; where the tensor-parallel size does not
divide the kv heads (but is a multiple of them) a kv head is replicated on the ranks whose query
heads read it.

Three ways a rank comes to be:

- ``leader``: an ordinary process built ``Engine.from_pretrained(..., tensor_parallel_size=N)``;
  it started ranks 1..N-1 itself (:func:`launch`) and sends them each scheduling call through a
  queue, so user code does not change.
- ``worker``: a process :func:`launch` started; it runs the leader's calls in order.
- ``spmd``: every rank runs the same program (``torchrun --nproc-per-node N``); nothing is sent.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import multiprocessing
import os
import queue
import socket
import threading
import time
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from phasegraph.runtime.errors import (
    InvalidConfig,
    RankDivergence,
    TensorParallelError,
    WorkerDied,
)

# NVLink multicast (NVLS) must stay off on shared hosts: a program that uses it can take the
# host's GPUs out of service. Set before NCCL starts, inherited by the ranks we start.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_POLL_S = 0.5  # how often a waiting worker looks whether its leader still lives


@attrs.define(eq=False)
class TensorParallelGroup:
    """This process's rank in a tensor-parallel engine, and the collectives the target uses."""

    rank: int
    world_size: int
    backend: str  # "gloo" (CPU) or "nccl" (GPU)
    device: torch.device
    timeout_s: float
    mode: str  # "leader", "worker" or "spmd"
    workers: list = attrs.field(factory=list)  # leader: the started processes, rank order
    commands: list = attrs.field(factory=list)  # leader: one queue per worker
    errors: object = None  # leader: the queue a failing worker writes its traceback to
    closed: bool = False
    symm: list = attrs.field(factory=list)  # tp_all_reduce="symm_mem": two symmetric buffers, flat
    symm_parity: int = 0  # which of them the next all-reduce uses
    symm_group: str | None = None
    reduce_dtype: torch.dtype | None = None  # the row-parallel sums' dtype (None: the model's)
    timed: bool = False  # add each all-reduce's host time to collective_ns (a traced CPU rank)
    collective_ns: int = 0  # all-reduce host time so far, while timed

    def collective_seconds(self) -> float:
        """Seconds this rank spent in :meth:`all_reduce_` while ``timed`` (a trace's clock)."""
        return self.collective_ns * 1e-9

    @property
    def sends(self) -> bool:
        """Whether this rank sends the scheduling calls (the leader of started workers)."""
        return self.mode == "leader"

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] summed over ranks, in place
        """Sum ``x`` over the ranks in place (capturable in a CUDA graph with NCCL)."""
        if not self.timed:
            return self._all_reduce_(x)
        # gloo blocks the host until every rank has sent its part, so host time is the
        # collective's (waiting for a slower rank included)
        start = time.perf_counter_ns()
        try:
            return self._all_reduce_(x)
        finally:
            self.collective_ns += time.perf_counter_ns() - start

    def _all_reduce_(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] in place
        if self.symm and x.dtype == self.symm[0].dtype and x.numel() <= self.symm[0].numel() and x.is_cuda:
            return self._symm_all_reduce_(x)
        try:
            dist.all_reduce(x)
        except (RuntimeError, ValueError) as exc:  # gloo: peer closed; a timeout; NCCL errors
            raise self.died(f"an all-reduce failed on rank {self.rank}: {exc}") from None
        return x

    def enable_symmetric_memory(self, max_bytes: int, dtype: torch.dtype) -> None:
        """Small all-reduces through torch's symmetric memory (one-shot: every rank reads its
        peers' buffers over NVLink, no multicast) instead of NCCL, whose launch latency
        dominates a decode step's small messages. A collective: every rank calls it."""
        if self.symm:
            return
        if self.device.type != "cuda":
            raise InvalidConfig("tp_all_reduce='symm_mem' needs CUDA devices")
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch, a no-op later
            enable(name)
        count = max_bytes // torch.empty((), dtype=dtype).element_size()
        for _ in range(2):
            buf = symm_mem.empty(count, dtype=dtype, device=self.device)
            symm_mem.rendezvous(buf, name)
            self.symm.append(buf)
        self.symm_group = name

    def _symm_all_reduce_(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] in place
        # Two buffers used in turn: a rank refills one only after every peer entered the
        # all-reduce after the one that read it (each starts with a barrier). A forward has
        # an even number of all-reduces and starts on buffer 0 (start_forward), so this holds
        # across forwards too, whichever graphs replay in whichever order.
        buf = self.symm[self.symm_parity][: x.numel()]
        self.symm_parity ^= 1
        buf.copy_(x.reshape(-1))
        ops = torch.ops.symm_mem
        if hasattr(ops, "one_shot_all_reduce_out"):
            ops.one_shot_all_reduce_out(buf, "sum", self.symm_group, x.view(-1))
        else:
            x.copy_(ops.one_shot_all_reduce(buf, "sum", self.symm_group).view_as(x))
        return x

    def start_forward(self) -> None:
        """A forward begins: its first all-reduce uses symmetric buffer 0."""
        self.symm_parity = 0

    @contextlib.contextmanager
    def _collective(self, what: str = "a collective"):
        """A host-side collective's failure (a rank gone, a timeout) as :class:`WorkerDied`."""
        try:
            yield
        except (RuntimeError, ValueError) as exc:
            raise self.died(f"{what} failed on rank {self.rank}: {exc}") from None

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (pool sizes: every rank must agree)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        with self._collective():
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def same_floats(self, values: list[float]) -> list[float]:
        """Rank 0's ``values`` on every rank: timings each rank measured for itself, which
        decisions every rank must take alike are made from."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with self._collective():
            dist.broadcast(t, src=0)
        return t.tolist()

    def check_same(self, checksum: int, what: str) -> None:
        """:class:`RankDivergence` unless every rank passed the same ``checksum``."""
        t = torch.tensor([checksum, -checksum], dtype=torch.int64, device=self.device)
        with self._collective("the divergence check"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        high, low = int(t[0]), -int(t[1])
        if high != low:
            raise RankDivergence(
                f"the tensor-parallel ranks diverged: {what} checksums range over [{low}, {high}] "
                f"(rank {self.rank} has {checksum})"
            )

    # -- the leader's workers ------------------------------------------------------------------

    def died(self, message: str) -> WorkerDied:
        """The error to raise: names a worker that exited, with what it reported."""
        detail = self._worker_report()
        for rank, proc in enumerate(self.workers, start=1):
            if proc.exitcode is not None:
                return WorkerDied(f"tensor-parallel rank {rank} exited (code {proc.exitcode}); {message}",
                                  rank, detail)
        return WorkerDied(message, None, detail)

    def _worker_report(self) -> str | None:
        if self.errors is None:
            return None
        try:
            return self.errors.get(timeout=0.2)
        except (queue.Empty, OSError, ValueError):
            return None

    def check_workers(self) -> None:
        """:class:`WorkerDied` if a started worker is no longer alive."""
        for rank, proc in enumerate(self.workers, start=1):
            if not proc.is_alive():
                raise WorkerDied(f"tensor-parallel rank {rank} exited (code {proc.exitcode})", rank,
                                 self._worker_report())

    def send(self, *command) -> None:
        """Queue one scheduling call for every worker (leader only)."""
        if self.closed:
            raise WorkerDied("this tensor-parallel engine was shut down")
        self.check_workers()
        for q in self.commands:
            q.put(command)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (bounded: a worker that does not exit in time is killed) and leave
        the process group."""
        if self.closed:
            return
        self.closed = True
        for q in self.commands:
            with contextlib.suppress(OSError, ValueError):  # a closed queue: its worker is gone
                q.put(("shutdown",))
        # every rank meets here first (the workers once they read "shutdown"), so no rank
        # leaves while another's last collective is still in flight; not with a dead rank, whose
        # collective would only time out
        if all(proc.is_alive() for proc in self.workers):
            with contextlib.suppress(WorkerDied):  # a rank that died at the last meeting: leave anyway
                self.min_int(0)
        if self.symm and self.mode == "leader":
            _SYMM_LEFT["left"] = True
        # the workers go first: the leader hosts the group's store, which a worker's NCCL
        # heartbeat still polls while it leaves (a leader gone first makes it print a trace)
        for proc in self.workers:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        left = _leave_group(timeout_s)
        if left and self.mode == "leader":
            _LAUNCHED["open"] = False


def _leave_group(timeout_s: float) -> bool:
    """Leave the process group, in a thread joined with a timeout (shutting an engine down must
    stay bounded); whether it was left. NCCL's orderly teardown (``destroy_process_group``)
    was seen to hang at exit, so an NCCL group is aborted instead where torch offers it
    (``_abort_process_group``, experimental): the engine is done with it either way."""
    if not dist.is_initialized():
        return True
    leave = dist.destroy_process_group
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if dist.get_backend() == "nccl" and abort is not None:
        leave = abort
    done = threading.Thread(target=leave, daemon=True)
    done.start()
    done.join(timeout_s)
    return not done.is_alive()



def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A GPU rank uses GPU ``local_rank``; a CPU rank the CPU."""
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise InvalidConfig(f"tensor-parallel rank {local_rank} needs GPU {local_rank}, but this machine has "
                                f"{torch.cuda.device_count()}")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def current_group(world_size: int, device: torch.device, timeout_s: float) -> TensorParallelGroup | None:
    """This process's group where it already is a rank (a started worker, or SPMD under torchrun
    with ``WORLD_SIZE`` set); None where it must start its own workers."""
    if dist.is_initialized():
        if _LAUNCHED["open"]:  # this process led an engine whose group outlived its shutdown
            raise TensorParallelError(
                "the process group of an earlier tensor-parallel engine of this process is still open (its "
                "shutdown did not finish in time): start the new engine in a fresh process"
            )
        if dist.get_world_size() != world_size:
            raise InvalidConfig(f"tensor_parallel_size={world_size}, but this process group has "
                                f"{dist.get_world_size()} ranks")
        mode = _WORKER_MODE.get("mode", "spmd")
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return TensorParallelGroup(dist.get_rank(), world_size, dist.get_backend(), rank_device(device, local),
                                   timeout_s, mode)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun: every rank runs this code
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise InvalidConfig(f"tensor_parallel_size={world_size}, but torchrun started "
                                f"{os.environ['WORLD_SIZE']} ranks")
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        dev = rank_device(device, local)
        for key, value in _NO_MULTICAST.items():
            os.environ.setdefault(key, value)
        dist.init_process_group(backend_for(dev), timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
        return TensorParallelGroup(dist.get_rank(), world_size, backend_for(dev), dev, timeout_s, "spmd")
    return None


_WORKER_MODE: dict[str, str] = {}
_LAUNCHED = {"open": False}  # whether a group this process started as leader is still open
# whether a group of this process that used symmetric memory was left: on 2xH200 a second
# group's symm_mem engine in the same process hung in its first all-reduces (2 of 2 runs)
_SYMM_LEFT = {"left": False}


def check_symmetric_memory_fresh() -> None:
    """:class:`TensorParallelError` where an earlier group of this process used symmetric
    memory (checked before any rank starts: a hang becomes a named error)."""
    if _SYMM_LEFT["left"]:
        raise TensorParallelError(
            "tp_all_reduce='symm_mem' in a second tensor-parallel engine of one process hung on GPUs (torch's "
            "symmetric memory keeps the first group's state): start this engine in a fresh process, or use "
            "tp_all_reduce='nccl'"
        )


def launch(
    world_size: int,
    device: torch.device,
    timeout_s: float,
    worker: Callable,
    load: tuple,
) -> TensorParallelGroup:
    """Start ranks 1..world_size-1 as processes running ``worker(rank, world_size, init_method,
    device, timeout_s, load, commands, errors)`` and join them as rank 0."""
    for key, value in _NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise InvalidConfig(f"tensor_parallel_size={world_size} needs {world_size} GPUs; this machine has "
                            f"{torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_method = f"tcp://127.0.0.1:{port}"
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    commands, workers = [], []
    for rank in range(1, world_size):
        q = ctx.Queue()
        proc = ctx.Process(target=worker, args=(rank, world_size, init_method, device.type, timeout_s, load, q, errors),
                           daemon=True, name=f"phasegraph-tp-rank{rank}")
        proc.start()
        commands.append(q)
        workers.append(proc)
    dev = rank_device(device, 0)
    group = TensorParallelGroup(0, world_size, backend_for(dev), dev, timeout_s, "leader", workers, commands, errors)
    # joined in a thread, so that a worker that dies while it starts (a bad checkpoint, an
    # import error) is reported now rather than when the join times out
    outcome: list[BaseException | None] = []

    def join() -> None:
        try:
            init_rank(0, world_size, init_method, dev, timeout_s)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            outcome.append(exc)

    joiner = threading.Thread(target=join, daemon=True)
    joiner.start()
    while joiner.is_alive() and all(proc.exitcode is None for proc in workers):
        joiner.join(_POLL_S)
    if not outcome or outcome[0] is not None:
        failure = group.died(f"the tensor-parallel ranks could not join: {outcome[0] if outcome else 'a rank exited'}")
        group.closed = True
        for proc in workers:
            proc.kill()
        raise failure
    _LAUNCHED["open"] = True
    return group


def init_rank(rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float) -> None:
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)


def start_worker(rank: int, world_size: int, init_method: str, device_type: str, timeout_s: float) -> None:
    """Join the leader's group as ``rank`` (in a process :func:`launch` started)."""
    _WORKER_MODE["mode"] = "worker"
    dev = rank_device(torch.device(device_type), rank)
    init_rank(rank, world_size, init_method, dev, timeout_s)


def next_command(commands) -> tuple | None:
    """The leader's next call; None once the leader is gone (the worker then exits)."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return commands.get(timeout=_POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None


def check_same_record(group: TensorParallelGroup, record: dict, what: str) -> None:
    """:class:`RankDivergence` unless every rank holds the same ``record`` (a JSON-like dict:
    a cost table's ``to_dict``, say)."""
    digest = hashlib.sha256(repr(record).encode()).digest()
    group.check_same(int.from_bytes(digest[:7], "little"), what)


def check_divergence(group: TensorParallelGroup, token_lists, plan: tuple[int, ...] = ()) -> None:
    """All-reduce a checksum of the tokens every request emitted so far and of ``plan``
    (integers naming adaptive speculation's latest plan) (``tp_check=True``)."""
    total = 0
    for tokens in (*token_lists, plan):
        for i, t in enumerate(tokens):
            total = (total + (i + 1) * (int(t) + 1) * 1_000_003) % (1 << 61)
    group.check_same(total, "emitted-token and plan")
