"""Tensor parallelism: the model's heads and MLP split over ``tp`` ranks, one process per rank.

Megatron-style splits of each layer: rank ``r`` of ``tp`` holds query heads
``[r H / tp, (r + 1) H / tp)`` and the kv heads they read (``Hkv / tp``; ``Hkv`` must divide by
``tp`` so that a GQA group never straddles two ranks), the matching rows of the output
projection's input, and the slice ``[r I / tp, (r + 1) I / tp)`` of the MLP's intermediate units.
Each rank's attention output projection and MLP down projection then give a partial sum of the
full one: the two all-reduces of a layer add them.  Embedding, norms and the LM head are
replicated, so every rank computes the same logits; rank 0 samples.

Each rank keeps the KV cache of its own kv heads with the same blocks: the scheduler runs once,
on rank 0, and each step's plan (its host index arrays, a few kilobytes) is broadcast, so every
rank runs the same steps over the same block tables.

Communication goes through a :class:`Group`:

* :class:`SocketGroup`: a star over ``multiprocessing.connection`` (rank 0 listens on
  ``MASTER_ADDR:MASTER_PORT``).  It broadcasts objects, and all-reduces NumPy arrays on the host
  (rank 0 adds the ranks' parts in rank order, so every run adds alike).  The CPU backend's
  communicator, and the channel through which NCCL's unique id travels.
* :class:`NcclGroup`: ``cupy.cuda.nccl`` all-reduces of device arrays on the step's stream; objects
  go through its socket group.  NCCL's NVLink multicast (NVLS) is left off
  (``NCCL_NVLS_ENABLE=0``), and ``NCCL_SOCKET_IFNAME`` / NCCL's network transport span nodes the
  same way, unchanged here.

Ranks come from the environment the usual launchers set: ``torchrun`` (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or Open MPI's ``mpirun``
(``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``, with
``MASTER_ADDR`` / ``MASTER_PORT`` given on its command line: ``mpirun -x MASTER_ADDR=...``).
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import sys
import time

import numpy as np

AUTHKEY = b"cupy_paged-tp"


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where this process sits: its rank, the world size, its GPU on the node, and where rank 0
    listens: ``MASTER_ADDR`` and the port after ``MASTER_PORT`` (torchrun's agent holds that one
    for its own rendezvous store)."""

    rank: int
    world_size: int
    local_rank: int
    address: str
    port: int


def ranks_from_environment(environ=None) -> Ranks:
    """The launcher's variables (torchrun's, else Open MPI's); a single process without either.

    >>> ranks_from_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
    ...                         "MASTER_PORT": "29511"})
    Ranks(rank=1, world_size=2, local_rank=1, address='127.0.0.1', port=29512)
    """
    env = os.environ if environ is None else environ
    rank = env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", "0"))
    size = env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", "1"))
    local = env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
    return Ranks(int(rank), int(size), int(local), env.get("MASTER_ADDR", "127.0.0.1"),
                 int(env.get("MASTER_PORT", "29500")) + 1)


class SocketGroup:
    """Broadcast and host all-reduce over sockets: rank 0 connected to every other rank.

    Parameters
    ----------
    ranks : Ranks
    timeout : float
        Seconds a rank waits for rank 0 to listen.
    """

    def __init__(self, ranks: Ranks, timeout: float = 60.0):
        from multiprocessing.connection import Client, Listener

        self.rank, self.world_size = ranks.rank, ranks.world_size
        self._peers = []  # rank 0: connections to ranks 1.. in rank order; others: [rank 0]
        if self.world_size == 1:
            return
        if self.rank == 0:
            with Listener((ranks.address, ranks.port), authkey=AUTHKEY) as listener:
                joined = {}
                while len(joined) < self.world_size - 1:
                    connection = listener.accept()
                    joined[connection.recv()] = connection
            self._peers = [joined[r] for r in range(1, self.world_size)]
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    connection = Client((ranks.address, ranks.port), authkey=AUTHKEY)
                    break
                except ConnectionRefusedError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            connection.send(self.rank)
            self._peers = [connection]

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (others pass nothing)."""
        if self.world_size == 1:
            return obj
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            for peer in self._peers:
                peer.send_bytes(payload)
            return obj
        return pickle.loads(self._peers[0].recv_bytes())

    def all_reduce(self, array):
        """The sum of every rank's ``array`` (NumPy), on every rank; added in rank order."""
        if self.world_size == 1:
            return array
        if self.rank == 0:
            total = np.array(array, copy=True)
            for peer in self._peers:
                total += np.frombuffer(peer.recv_bytes(), array.dtype).reshape(array.shape)
            payload = total.tobytes()
            for peer in self._peers:
                peer.send_bytes(payload)
            return total
        self._peers[0].send_bytes(np.ascontiguousarray(array).tobytes())
        return np.frombuffer(self._peers[0].recv_bytes(), array.dtype).reshape(array.shape).copy()

    def close(self) -> None:
        for peer in self._peers:
            peer.close()
        self._peers = []


class NcclGroup:
    """All-reduces of CuPy arrays through NCCL on the current stream; objects through sockets.

    The unique id is made on rank 0 and broadcast through the socket group.  Each rank uses the
    GPU of its local rank.
    """

    def __init__(self, ranks: Ranks):
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off in everything we start
        import cupy
        from cupy.cuda import nccl

        cupy.cuda.Device(ranks.local_rank).use()
        self.sockets = SocketGroup(ranks)
        self.rank, self.world_size = ranks.rank, ranks.world_size
        unique_id = self.sockets.broadcast(nccl.get_unique_id() if ranks.rank == 0 else None)
        self.comm = nccl.NcclCommunicator(self.world_size, unique_id, self.rank)
        self._nccl = nccl
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.float16): nccl.NCCL_FLOAT16}

    def broadcast(self, obj=None):
        return self.sockets.broadcast(obj)

    def all_reduce(self, array):
        """In place: the sum over ranks of the contiguous CuPy ``array`` (float32/64, float16)."""
        import cupy

        stream = cupy.cuda.get_current_stream().ptr
        self.comm.allReduce(array.data.ptr, array.data.ptr, array.size, self._types[np.dtype(array.dtype)],
                            self._nccl.NCCL_SUM, stream)
        return array

    def close(self) -> None:
        self.sockets.close()


def shard(config, weights: dict, rank: int, tp: int):
    """``(config, weights)`` of rank ``rank`` of ``tp``: its heads and intermediate units.

    Raises
    ------
    ValueError
        When the query heads, kv heads or intermediate size do not divide by ``tp``.

    Examples
    --------
    >>> from llama.config import CPU_DEFAULT
    >>> from llama.weights import random_weights
    >>> part, w = shard(CPU_DEFAULT, random_weights(CPU_DEFAULT), 1, 2)
    >>> part.num_attention_heads, part.num_key_value_heads, part.head_dim == CPU_DEFAULT.head_dim
    (2, 1, True)
    """
    c = config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(c, name) % tp:
            raise ValueError(f"{name} = {getattr(c, name)} does not divide by tp = {tp}")
    part = dataclasses.replace(c, num_attention_heads=c.num_attention_heads // tp,
                               num_key_value_heads=c.num_key_value_heads // tp,
                               intermediate_size=c.intermediate_size // tp, head_dim=c.head_dim)
    q = slice(rank * part.q_size, (rank + 1) * part.q_size)
    kv = slice(rank * part.kv_size, (rank + 1) * part.kv_size)
    mlp = slice(rank * part.intermediate_size, (rank + 1) * part.intermediate_size)
    rows = {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": kv, "self_attn.v_proj.weight": kv,
            "mlp.gate_proj.weight": mlp, "mlp.up_proj.weight": mlp}
    columns = {"self_attn.o_proj.weight": q, "mlp.down_proj.weight": mlp}
    out = {}
    for name, value in weights.items():
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else None
        if suffix in rows:
            out[name] = np.ascontiguousarray(value[rows[suffix]])
        elif suffix in columns:
            out[name] = np.ascontiguousarray(value[:, columns[suffix]])
        else:
            out[name] = value
    return part, out


# --------------------------------------------------------------------------- plans between ranks

# The scheduler's bookkeeping.
_RANK_0_ONLY = ("seq_ids", "sample_requests", "sample_rows", "num_decodes")


def plan_message(plan) -> dict:
    """What another rank needs of rank 0's plan: every field but the scheduler's bookkeeping, its
    index arrays on the host."""
    import dataclasses

    from cupy_paged._core.arrays import to_host

    message = {}
    for field in dataclasses.fields(plan):
        value = getattr(plan, field.name)
        if field.name not in _RANK_0_ONLY:
            message[field.name] = value if value is None or np.isscalar(value) else np.asarray(to_host(value))
    message["batch"] = len(plan.seq_ids)
    return message


def plan_from_message(message: dict, xp):
    """The StepPlan of a broadcast message, its index arrays on this rank's side (``xp``)."""
    import cupy_paged

    fields = {name: xp.asarray(value) if isinstance(value, np.ndarray) and name != "sample_mask" else value
              for name, value in message.items() if name != "batch"}
    return cupy_paged.StepPlan(seq_ids=[None] * message["batch"], **fields)


# --------------------------------------------------------------------------- a local launcher

def free_port() -> int:
    """A TCP port nothing listens on now (for rank 0 of a local run)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_local(target, tp: int, *args) -> int:
    """Run ``target(*args)`` in ``tp`` new processes on this machine, each with torchrun's
    variables set for its rank (what ``torchrun --nproc-per-node tp`` does); the largest exit code.
    ``target`` must be importable by name (a module-level function)."""
    import multiprocessing

    port = free_port() - 1  # ranks listen on MASTER_PORT + 1
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_rank_main, args=(target, rank, tp, port, args)) for rank in range(tp)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return max(process.exitcode or 0 for process in processes)


def _rank_main(target, rank: int, tp: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
    sys.exit(target(*args) or 0)
