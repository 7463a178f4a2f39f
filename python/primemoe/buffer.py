"""``primemoe.Buffer``: the NVSHMEM runtime of expert parallelism (DESIGN.md sections 3, 4).

One Buffer = one symmetric workspace (csrc/runtime/ep_workspace.cuh), sized for the
worst case and shared by every layer and call. NVSHMEM is bootstrapped over a
torch.distributed group: a unique id made on the group's rank 0 and broadcast.
A process holds one NVSHMEM instance: it is initialised by the first open Buffer and
finalised when the last one closes, so a job can create, destroy and recreate buffers.

Freeing is collective (every rank of the group must call ``close()``), so an open
Buffer is never left to the garbage collector: it stays alive until ``close()`` or
interpreter exit.

Transport, per peer: ranks that NVSHMEM maps into this GPU (same node, NVLink) are written
by plain stores, the others (another node) by NVSHMEM puts from a staging region of the
workspace, which exists only when some rank needs it. ``PRIMEMOE_EP_TRANSPORT``, read
when a Buffer is created: ``auto`` (the default) or ``put``, which sends to every other
rank by puts, as if it were on another node (on one node NVSHMEM still carries them over
NVLink: it tests the put path).
"""

from __future__ import annotations

import atexit
import os
import socket
import warnings
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from ._constants import MAX_LOCAL_EXPERTS, layout_max_rows
from ._validate import FP8_PRECISIONS, check_fp8_buffer, check_precision

__all__ = ["Buffer", "EpConfig", "buffer_config", "ep_arrivals_per_epoch", "ep_layout", "ep_region", "ep_transport",
           "nvshmem_environment"]

lib = torch.ops.primemoe

# The receive layout's default alignment. The engine takes any multiple of _constants.ROW_ALIGN (64, whose half
# tiles spare padding work on one GPU); the expert-parallel suite last ran on two GPUs at 128.
EP_ROW_ALIGN = 128

# Room on the symmetric heap beyond the workspace (NVSHMEM's own symmetric objects).
SYMMETRIC_HEAP_MARGIN = 256 << 20
_INT32_MAX = 2 ** 31 - 1
# Dispatch/combine SMs: on 2x H200 (NVLink) both directions moved more bytes per second with 16 than
# with 24 at >= 8192 tokens per rank (benchmarks/RESULTS.md, fourth session).
DEFAULT_NUM_SMS = 16
# The send-side layout spans all experts of the group.
MAX_EXPERTS = MAX_LOCAL_EXPERTS
EP_TRANSPORTS = ("auto", "put")


@dataclass(frozen=True)
class EpConfig:
    """The sizes the workspace layout depends on (``EpConfig`` of ep_workspace.cuh)."""

    world: int
    max_tokens: int
    hidden: int
    top_k: int
    local_experts: int
    row_align: int
    put_peers: bool  # some rank sends by NVSHMEM puts: the workspace has the staging region
    recv_capacity: int = 0  # routed rows a rank can receive per dispatch (0: every slot of every rank)

    @property
    def max_slots(self) -> int:
        return self.max_tokens * self.top_k

    @property
    def recv_slots(self) -> int:
        worst = self.world * self.max_slots
        return min(self.recv_capacity, worst) if self.recv_capacity > 0 else worst

    @property
    def max_recv_rows(self) -> int:
        """Rows of the receive layout: ``recv_slots`` (every slot of every rank, or the capacity), each local
        expert padded."""
        return layout_max_rows(self.recv_slots, self.local_experts, self.row_align)


# Element types of the regions; the uint64 counters and flags are viewed as int64 (the same bytes; torch has few
# uint64 kernels).
_ELEMENT_DTYPES = {"int32": torch.int32, "uint64": torch.int64, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _layout_text(config: EpConfig) -> List[List[str]]:
    text = lib._ep_workspace_layout(config.world, config.max_tokens, config.hidden, config.top_k,
                                    config.local_experts, config.row_align, config.put_peers, config.recv_capacity)
    return [line.split() for line in text.splitlines()]


def ep_arrivals_per_epoch(config: EpConfig) -> int:
    """What each expert's arrival counter gains per dispatch (``ep_arrivals_per_epoch`` of ep_workspace.cuh)."""
    return next(int(fields[0]) for name, *fields in _layout_text(config) if name == "arrivals_per_epoch")


def ep_layout(config: EpConfig) -> Tuple[Dict[str, Tuple[int, torch.dtype, Tuple[int, ...]]], int]:
    """``({name: (byte offset, dtype, shape)}, total bytes)`` of the workspace, in allocation order: the
    kernels' own layout (``ep_regions`` of csrc/runtime/ep_workspace.cuh, through ``_ep_workspace_layout``)."""
    layout: Dict[str, Tuple[int, torch.dtype, Tuple[int, ...]]] = {}
    total = -1
    for name, *fields in _layout_text(config):
        if name == "total":
            total = int(fields[0])
        elif name != "arrivals_per_epoch":
            element, offset, shape = fields
            layout[name] = (int(offset), _ELEMENT_DTYPES[element], tuple(int(n) for n in shape.split(",")))
    return layout, total


def ep_region(workspace: torch.Tensor, name: str, world: int, max_tokens: int, hidden: int, top_k: int,
              local_experts: int, row_align: int, put_peers: bool, recv_capacity: int = 0) -> torch.Tensor:
    """The region ``name`` of a workspace (uint8 tensor) as a typed view with its shape."""
    layout, total = ep_layout(EpConfig(world, max_tokens, hidden, top_k, local_experts, row_align, put_peers,
                                       recv_capacity))
    if name not in layout:
        raise KeyError(f"ep_region: unknown region {name!r}; expected one of {list(layout)}")
    if workspace.dtype != torch.uint8 or workspace.dim() != 1 or workspace.numel() < total:
        raise ValueError(f"ep_region: expected a uint8 workspace of at least {total} bytes, "
                         f"got {workspace.dtype} of shape {tuple(workspace.shape)}")
    offset, dtype, shape = layout[name]
    numel = 1
    for n in shape:
        numel *= n
    return workspace[offset:offset + numel * dtype.itemsize].view(dtype).view(shape)


def ep_transport(env: Mapping[str, str]) -> str:
    """``PRIMEMOE_EP_TRANSPORT`` from ``env``: ``auto`` (unset) or ``put`` (see the module docstring)."""
    value = env.get("PRIMEMOE_EP_TRANSPORT", "auto")
    if value not in EP_TRANSPORTS:
        raise ValueError(f"PRIMEMOE_EP_TRANSPORT: expected one of {list(EP_TRANSPORTS)}, got {value!r}")
    return value


def nvshmem_environment(env: Mapping[str, str], hostnames: Sequence[str],
                        workspace_bytes: int) -> Tuple[Dict[str, str], List[str]]:
    """The NVSHMEM_* variables to set before ``_nvshmem_init`` and the warnings to give.

    NVLink multicast (NVLS) is always disabled, overriding the user. Every other
    variable the user set is kept; unset ones get: no remote transport when all ranks
    share one host, and a symmetric heap of the workspace plus a margin.
    """
    updates: Dict[str, str] = {}
    warns: List[str] = []
    nvls = env.get("NVSHMEM_DISABLE_NVLS")
    if nvls != "1":
        if nvls is not None:
            warns.append(f"primemoe.Buffer: NVSHMEM_DISABLE_NVLS={nvls!r} overridden to '1': "
                         "NVLink multicast must stay off")
        updates["NVSHMEM_DISABLE_NVLS"] = "1"
    if "NVSHMEM_REMOTE_TRANSPORT" not in env and len(set(hostnames)) == 1:
        updates["NVSHMEM_REMOTE_TRANSPORT"] = "none"
    if "NVSHMEM_SYMMETRIC_SIZE" not in env:
        updates["NVSHMEM_SYMMETRIC_SIZE"] = str(workspace_bytes + SYMMETRIC_HEAP_MARGIN)
    return updates, warns


def buffer_config(world: int, *, max_tokens_per_rank, hidden, intermediate, num_experts, top_k,
                  row_align, num_sms, max_recv_rows=None) -> EpConfig:
    """Checks the sizes of a Buffer (clear errors naming the argument) and returns its layout config,
    without the staging region (whether some rank needs puts is known once NVSHMEM is up)."""
    sizes = dict(max_tokens_per_rank=max_tokens_per_rank, hidden=hidden, intermediate=intermediate,
                 num_experts=num_experts, top_k=top_k, row_align=row_align, num_sms=num_sms)
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value}")
    # 16-byte rows for the copies, TMA and the grouped GEMMs.
    if hidden % 8:
        raise ValueError(f"hidden: expected a multiple of 8, got {hidden}")
    if intermediate % 8:
        raise ValueError(f"intermediate: expected a multiple of 8, got {intermediate}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts: at most {MAX_EXPERTS} experts are supported, got {num_experts}")
    if num_experts % world:
        raise ValueError(f"num_experts: {num_experts} experts cannot be split evenly over the group's "
                         f"{world} ranks (expected a multiple of {world})")
    if max_recv_rows is not None:
        if isinstance(max_recv_rows, bool) or not isinstance(max_recv_rows, int):
            raise TypeError(f"max_recv_rows: expected an int or None, got {type(max_recv_rows).__name__}")
        if max_recv_rows < max_tokens_per_rank * top_k:
            raise ValueError(f"max_recv_rows: expected at least max_tokens_per_rank * top_k = "
                             f"{max_tokens_per_rank * top_k} (a rank's own slots), got {max_recv_rows}")
    config = EpConfig(world, max_tokens_per_rank, hidden, top_k, num_experts // world, row_align, put_peers=False,
                      recv_capacity=max_recv_rows or 0)
    # recv_meta holds src_rank * max_slots + slot in int32.
    if config.max_recv_rows > _INT32_MAX:
        raise ValueError(f"max_tokens_per_rank: {world} ranks x {max_tokens_per_rank} tokens x top_k {top_k} "
                         f"= {config.max_recv_rows} receive rows exceed the int32 row index")
    return config


# ---------------------------------------------------------------- the process's NVSHMEM instance

_open_buffers: List["Buffer"] = []  # open buffers in creation order; NVSHMEM is up while non-empty
# (global ranks of the group, CUDA device) of the first init. NVSHMEM keeps its bootstrap for the
# life of the process (a re-init after finalize reuses it), so every later Buffer must match it.
_bootstrap: Optional[Tuple[Tuple[int, ...], int]] = None
_env_set_here: Dict[str, str] = {}  # variables this module set, recomputed at the next init


def _close_all_at_exit():
    for buffer in reversed(list(_open_buffers)):
        buffer.close()


atexit.register(_close_all_at_exit)


def _on_any_rank(group, flag: bool) -> bool:
    flags: List[Optional[bool]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, flag, group=group)
    return any(flags)


def _check_agreed(group, arguments: Dict[str, object], refused: Optional[BaseException]) -> None:
    """Gathers every rank's Buffer arguments and whether it refused them; raises on every rank (this rank's own
    error where it refused, else a ValueError naming the rank that did or the argument that differs)."""
    world = dist.get_world_size(group)
    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, {"arguments": arguments, "refused": None if refused is None else str(refused)},
                           group=group)
    if refused is not None:
        raise refused
    for rank, theirs in enumerate(gathered):
        if theirs["refused"] is not None:
            raise ValueError(f"primemoe.Buffer: rank {rank} of the group refused its arguments "
                             f"({theirs['refused']}); every rank must create the Buffer with the same valid ones")
    for name, value in arguments.items():
        values = [theirs["arguments"][name] for theirs in gathered]
        if any(v != value for v in values):
            listed = ", ".join(f"rank {rank}: {v!r}" for rank, v in enumerate(values))
            raise ValueError(f"primemoe.Buffer: {name} differs between the ranks of the group ({listed}); every "
                             f"rank must create the Buffer with the same arguments")


def _nvshmem_started_elsewhere() -> Optional[RuntimeError]:
    """The error for NVSHMEM already running in this process without a primemoe.Buffer (another library started
    it, e.g. torch's symmetric memory on its NVSHMEM backend), else None. Checked on every rank before the
    bootstrap and agreed on, so no rank is left waiting in it."""
    if _open_buffers or not lib._nvshmem_initialized():
        return None
    return RuntimeError(
        "primemoe.Buffer: NVSHMEM is already initialised in this process by another library (e.g. torch's symmetric "
        "memory with its NVSHMEM backend); a Buffer bootstraps NVSHMEM over its own group and cannot share an "
        "instance it did not start: in a process that holds Buffers, use torch's symmetric memory on another "
        "backend")


def _start_nvshmem(group, rank: int, world: int, device: int, config: EpConfig, force_put: bool) -> None:
    global _bootstrap
    hostnames: List[Optional[str]] = [None] * world
    dist.all_gather_object(hostnames, socket.gethostname(), group=group)
    # The heap is sized now, before the peers can be probed: with room for the staging region
    # wherever puts may be needed.
    may_put = _on_any_rank(group, force_put) or len(set(hostnames)) > 1
    _, workspace_bytes = ep_layout(replace(config, put_peers=may_put))
    user_env = {k: v for k, v in os.environ.items() if _env_set_here.get(k) != v}
    updates, warns = nvshmem_environment(user_env, hostnames, workspace_bytes)
    for message in warns:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    for name, value in updates.items():
        os.environ[name] = value
        _env_set_here[name] = value

    holder = [lib._nvshmem_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(holder, group=group, group_src=0)
    with torch.cuda.device(device):
        lib._nvshmem_init(holder[0], rank, world)
    _bootstrap = (tuple(dist.get_process_group_ranks(group)), device)


class Buffer:
    """Expert-parallel runtime over ``group``: NVSHMEM plus one symmetric workspace.

    ``primemoe.moe(..., buffer=buf)`` runs the experts of this rank
    (``local_experts = num_experts // world``, global ids ``rank * local_experts + e``)
    on at most ``max_tokens_per_rank`` tokens per rank. Collective: every rank of
    ``group`` creates it with the same arguments, and calls ``close()`` (or exits).
    ``row_align``: each local expert's received rows start at a multiple of it (padding rows
    are zero); the expert GEMM engine needs a multiple of 64 (the default is 128), else the
    experts run on ``torch._grouped_mm``.
    ``precision``: the one ``primemoe.moe(..., buffer=)`` runs with. "fp8" / "fp8_bwd" need ``hidden``,
    ``intermediate`` and ``row_align`` multiples of 128 (the FP8 layout); the rows still travel in bf16.
    ``num_sms``: SMs the dispatch/combine kernels use (``DEFAULT_NUM_SMS``). A Buffer of one rank moves nothing
    between GPUs: its dispatch is a local copy on every SM, ``moe`` runs no GEMM beside it and sends nothing back.
    ``overlap``: FC1 runs alongside the dispatch, each expert's tiles starting once its rows have landed
    (True, the default); False runs them one after the other. Both give the same bits.
    ``overlap_combine`` (with ``overlap``): the combine also runs alongside the GEMM whose rows it sends back
    (FC2; FC1's dgrad in the backward), block by block as that GEMM publishes them. Bitwise equal to the
    default; off until measured on several GPUs (on one it has nothing to hide).
    ``max_recv_rows``: the most routed rows a rank receives in one dispatch (its experts' slots from every rank;
    None: the worst case, world x max_tokens_per_rank x top_k; at least max_tokens_per_rank x top_k). The
    receive region and the layer's row buffers (FC1's and FC2's outputs, the rows kept for the backward, its
    gradients) are sized like it, so setting it to the expected load times a margin (e.g. 2 x max_tokens_per_rank
    x top_k) bounds the layer's memory at large EP. A dispatch that would bring a rank more rows sends it none:
    every rank records the overflow (``primemoe.DeviceError`` at the next primemoe call or ``check_errors``), and
    that call's results are invalid.
    Set from the peers and ``PRIMEMOE_EP_TRANSPORT`` (attributes, not arguments): ``put_peers``, some
    rank sends by NVSHMEM puts (another node, or ``put``), so the workspace has the staging region;
    ``force_put``, this rank sends to every other by puts.
    """

    def __init__(self, group, *, max_tokens_per_rank, hidden, intermediate, num_experts, top_k,
                 precision="bf16", row_align=EP_ROW_ALIGN, num_sms=DEFAULT_NUM_SMS, overlap=True,
                 overlap_combine=False, max_recv_rows=None):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
        world = dist.get_world_size(group)
        arguments = dict(max_tokens_per_rank=max_tokens_per_rank, hidden=hidden, intermediate=intermediate,
                         num_experts=num_experts, top_k=top_k, precision=precision, row_align=row_align,
                         num_sms=num_sms, overlap=overlap, overlap_combine=overlap_combine, max_recv_rows=max_recv_rows)
        try:
            check_precision(precision)
            for name, flag in (("overlap", overlap), ("overlap_combine", overlap_combine)):
                if not isinstance(flag, bool):
                    raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
            transport = ep_transport(os.environ)
            config = buffer_config(world, max_tokens_per_rank=max_tokens_per_rank, hidden=hidden,
                                   intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                                   row_align=row_align, num_sms=num_sms, max_recv_rows=max_recv_rows)
            if precision in FP8_PRECISIONS:
                check_fp8_buffer(hidden, intermediate, row_align)
            refused = _nvshmem_started_elsewhere()
        except (TypeError, ValueError, NotImplementedError) as exc:
            transport, refused = None, exc
        # Collective, before CUDA and NVSHMEM: a rank whose arguments are refused, or that differ between ranks,
        # raises on every rank instead of leaving the others waiting in the bootstrap.
        _check_agreed(group, dict(arguments, PRIMEMOE_EP_TRANSPORT=transport), refused)
        force_put = transport == "put"
        if not torch.cuda.is_available():
            raise RuntimeError("primemoe.Buffer: needs CUDA (NVSHMEM runs on GPUs), but "
                               "torch.cuda.is_available() is False")

        self.group = group
        self.rank = dist.get_rank(group)
        self.world = world
        self.max_tokens_per_rank = max_tokens_per_rank
        self.hidden = hidden
        self.intermediate = intermediate
        self.num_experts = num_experts
        self.local_experts = config.local_experts
        self.top_k = top_k
        self.precision = precision
        self.row_align = row_align
        self.num_sms = num_sms
        self.max_recv_rows = max_recv_rows
        self.recv_capacity = config.recv_capacity  # the kernels' EpConfig::recv_capacity (0: the worst case)
        self.overlap = overlap
        self.overlap_combine = overlap and overlap_combine
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.force_put = force_put
        # One rank: the dispatch only copies this rank's rows into place, with nothing to run beside: every SM.
        self._dispatch_sms = (num_sms if world > 1 else
                              torch.cuda.get_device_properties(self.device).multi_processor_count)

        ranks = tuple(dist.get_process_group_ranks(group))
        if _bootstrap is not None and _bootstrap != (ranks, self.device.index):
            raise ValueError(
                f"group: NVSHMEM in this process was bootstrapped over global ranks {list(_bootstrap[0])} on "
                f"cuda:{_bootstrap[1]} and keeps that bootstrap for the life of the process; every Buffer "
                f"must use the same group and device (got ranks {list(ranks)} on {self.device})")
        if not _open_buffers:
            _start_nvshmem(group, self.rank, world, self.device.index, config, force_put)
        try:
            with torch.cuda.device(self.device):
                # Probed on every rank (collective) and agreed on, so the workspace has one size everywhere.
                self.put_peers = _on_any_rank(group, lib._nvshmem_peers_need_put() or force_put)
                config = replace(config, put_peers=self.put_peers)
                layout, self.nbytes = ep_layout(config)
                self.arrivals_per_epoch = ep_arrivals_per_epoch(config)
                self.workspace = lib._ep_workspace_alloc(self.nbytes)
                # Loaded now, not at their first launch: a lazily loaded kernel waits for the kernels running then.
                lib._preload_kernels()
        except RuntimeError as error:
            if not _open_buffers:
                lib._nvshmem_finalize()
            raise RuntimeError(
                f"primemoe.Buffer: could not allocate the symmetric workspace "
                f"(NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE')!r} must hold every open "
                f"Buffer's workspace): {error}") from error
        # Bumped on the device by every dispatch and never reset: the flags in the workspace compare against it.
        self.epoch = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._regions = {name: ep_region(self.workspace, name, world, max_tokens_per_rank, hidden, top_k,
                                         config.local_experts, row_align, self.put_peers, self.recv_capacity)
                         for name in layout}
        _open_buffers.append(self)
        from .ep import register_buffer
        self.handle = register_buffer(self)  # how the layer's ops name this buffer

    @property
    def closed(self) -> bool:
        return not hasattr(self, "workspace")

    def region(self, name: str) -> torch.Tensor:
        """A typed view of the workspace region ``name`` (see ``ep_layout``)."""
        self._check_open()
        return self._regions[name]

    def dispatch(self, x, topk_idx, topk_weights, *, wait=True, copy_rows=True):
        """Sends every routed row of ``x`` to its expert's rank (collective). Returns, for this rank
        as receiver, ``expert_counts`` int32 [E_local] and ``expert_offsets`` int32 [E_local + 1] of the
        ``recv_rows`` region, and as sender ``slot_valid`` bool [T, K]. ``wait=False``: the stream does
        not wait for the other ranks' rows; the consumer waits per expert on ``rows_ready()``. ``x``,
        ``topk_idx``, ``topk_weights`` and the returned tensors must stay alive until the work after the
        dispatch on the stream has ended (a GEMM may run alongside it). ``copy_rows=False``: everything but the
        rows themselves (``recv_meta``, ``recv_weights``, ``combine_map``, the counts): the caller puts them in."""
        self._check_open()
        return lib.ep_dispatch(self.workspace, self.epoch, x, topk_idx, topk_weights, self.rank, self.world,
                               self.max_tokens_per_rank, self.local_experts, self.row_align, self._dispatch_sms, wait,
                               self.put_peers, self.force_put, copy_rows, self.recv_capacity)

    def rows_ready(self):
        """The GEMM wait hook for the last dispatch: ``(counters, epoch, per_epoch, rank, tile_counter)``; local
        expert ``e``'s rows are all in ``recv_rows``, its padding rows too (zero data, source -1, weight 0), once
        ``counters[e] >= epoch * per_epoch``. ``tile_counter``: a claimed-tile counter the dispatch zeroed, for the
        one GEMM that waits on it."""
        self._check_open()
        return (self.region("expert_arrivals"), self.epoch, self.arrivals_per_epoch, self.rank,
                self.region("tile_counter"))

    def combine(self, rows, expert_offsets, row_scalars=None, *, published=False, send=True, wait=True) -> None:
        """Pushes each received row of ``rows`` ([max_recv_rows, H], receive layout) and of ``row_scalars``
        back to its source slot's ``combine_rows`` / ``combine_scalars`` (collective). The rows of this rank's own
        slots stay in ``rows``: row ``-2 - region("combine_map")[slot]`` (their scalars are written). One combine per
        dispatch. ``published``: ``rows`` is being written by the GEMM launched just before on the stream, which
        publishes each 64-row block in ``region("result_flags")`` (``expert_gemm``'s ``done_*``); the combine
        runs alongside it and sends each block once it is there. ``send`` / ``wait``: only the sending, or only
        the wait until every source has pushed this rank's slots back (then ``rows`` is not read): apart, the
        work between them does not wait for the slowest peer.
        ``expert_offsets``: from the dispatch whose receive layout ``rows`` is in."""
        self._check_open()
        lib.ep_combine(self.workspace, self.epoch, rows, row_scalars, expert_offsets, self.rank, self.world,
                       self.max_tokens_per_rank, self.hidden, self.top_k, self.local_experts, self.row_align,
                       self.num_sms, self.put_peers, self.force_put, published, send, wait, self.recv_capacity)

    def close(self) -> None:
        """Frees the workspace, and NVSHMEM with the last open Buffer (collective). Idempotent."""
        if self.closed:
            return
        with torch.cuda.device(self.device):
            workspace = self.workspace
            del self.workspace, self._regions, self.epoch
            _open_buffers.remove(self)
            from .ep import unregister_buffer
            unregister_buffer(self.handle)
            lib._ep_workspace_free(workspace)
            if not _open_buffers:
                lib._nvshmem_finalize()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("buffer: this primemoe.Buffer is closed")

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes on {self.device}"
        return (f"primemoe.Buffer(rank={self.rank}, world={self.world}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, num_experts={self.num_experts} "
                f"({self.local_experts} local), top_k={self.top_k}, precision={self.precision!r}, "
                f"row_align={self.row_align}, num_sms={self.num_sms}, max_recv_rows={self.max_recv_rows}, "
                f"overlap={self.overlap}, "
                f"overlap_combine={self.overlap_combine}; {state})")
