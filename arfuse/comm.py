"""Communicator: one rank's cross-GPU buffers for the fused op.

Each rank allocates a Lamport buffer (three slots, filled with the -0.0 sentinel), a control
block and a host-mapped error word outside torch's caching allocator, exchanges CUDA IPC handles
with its peers over a torch.distributed group (gloo or nccl) and opens theirs. Everything is
freed by close() or on leaving a `with` block.
"""

from __future__ import annotations

import socket

import torch

from . import _lib, _vocab


def _op(name: str, *args):
    """torch.ops.arfuse.<name>(*args), its argument errors as ValueError / TypeError."""
    try:
        return getattr(torch.ops.arfuse, name)(*args)
    except RuntimeError as e:
        _lib.reraise(e)


def _host_identity() -> tuple[str, str]:
    """(key, name) of the host this process runs on: processes with the same key share a kernel
    (its boot id; the host name where /proc has none), the name is for messages."""
    name = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip(), name
    except OSError:
        return name, name


def local_topology(device: torch.device) -> dict:
    """What the topology check needs to know of this rank: its host, its GPU (UUID and PCI bus
    id) and which of the GPUs visible to this process its GPU can reach as a peer."""
    key, name = _host_identity()
    props = torch.cuda.get_device_properties(device)
    access = {}
    for i in range(torch.cuda.device_count()):
        uuid = str(torch.cuda.get_device_properties(i).uuid)
        access[uuid] = i == device.index or torch.cuda.can_device_access_peer(device.index, i)
    return {"host": key, "hostname": name, "gpu": str(props.uuid),
            "bus": f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}",
            "access": access}


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}-{ranks[-1]}"


def topology_problems(infos: list[dict]) -> list[str]:
    """Why a group whose ranks are described by `infos` (local_topology of each rank, in rank
    order) cannot be served, or [] when it can. Every rank computes this from the same gathered
    list, so all of them come to the same answer. The kernels read and write every peer's buffer
    through CUDA IPC: all ranks must be on one host, and each rank's GPU must reach every other
    rank's GPU as a peer (or be the same GPU)."""
    hosts: dict[str, list[int]] = {}
    for r, info in enumerate(infos):
        hosts.setdefault(info["host"], []).append(r)
    if len(hosts) > 1:
        where = "; ".join(f"ranks {_ranks(rs)} on host {infos[rs[0]]['hostname']}"
                          for rs in hosts.values())
        return [f"the ranks are on {len(hosts)} hosts ({where}): every rank of the group must "
                "be on one host (tensor parallelism across nodes is not supported)"]
    problems = []
    for r, mine in enumerate(infos):
        for p, peer in enumerate(infos):
            if p == r or peer["gpu"] == mine["gpu"]:
                continue
            if peer["gpu"] not in mine["access"]:
                problems.append(f"rank {p}'s GPU ({peer['bus']}) is not visible to rank {r}'s "
                                "process (CUDA_VISIBLE_DEVICES must show every rank's GPU)")
            elif not mine["access"][peer["gpu"]]:
                problems.append(f"rank {r}'s GPU ({mine['bus']}) cannot access rank {p}'s GPU "
                                f"({peer['bus']}) as a peer (no P2P between them)")
    return problems


NUM_SLOTS = 3  # Lamport slots per buffer (kNumSlots, csrc/arfuse/protocol.h)


def max_ranks_per_gpu(infos: list[dict]) -> int:
    """The most ranks of the group on one GPU (by UUID), from the gathered local_topology of every
    rank. The kernels' protocol needs every rank's blocks resident at once: ranks that share a GPU
    (several processes on one GPU, under MPS or time-sliced) size their grids to 1/this of it.
    Every rank computes it from the same list, so all pass the same value."""
    counts: dict[str, int] = {}
    for info in infos:
        counts[info["gpu"]] = counts.get(info["gpu"], 0) + 1
    return max(counts.values(), default=1)


class Communicator:
    """Buffers and peers of one rank of a tensor-parallel group.

    Args:
        group: a torch.distributed ProcessGroup (None: the default group). Every rank of it must
            create its Communicator with the same arguments, at the same time.
        max_tokens: the most tokens one call may carry (checked on the host before each launch).
        hidden: hidden size H of the rows.
        dtype: activation dtype (torch.bfloat16, torch.float16 or torch.float32).
        oneshot_max_tokens: the most tokens a one-shot call may carry (default max_tokens); the
            buffer holds max(N * oneshot_max_tokens, ~2 * max_tokens) rows per slot.
        device: this rank's GPU (default: the current CUDA device).
        timeout_s: a wait for a peer longer than this gives up (outputs NaN, the communicator
            reports itself broken) instead of hanging.
        pdl: launch the fused kernels as programmatic dependents (see the ``pdl`` property).
    """

    def __init__(self, group=None, *, max_tokens: int, hidden: int, dtype: torch.dtype,
                 oneshot_max_tokens: int | None = None, device=None, timeout_s: float = 10.0,
                 pdl: bool = False):
        import torch.distributed as dist

        _lib.require()
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if world > _vocab.MAX_WORLD:  # every rank sees the same size: each refuses alone
            raise ValueError(f"arfuse: Communicator: group of {world} ranks not supported: a "
                             f"communicator serves 1..{_vocab.MAX_WORLD} ranks. Nothing was "
                             "allocated or opened.")
        ranks_per_device = 1
        if world > 1:
            # Before anything is allocated or opened: can every rank reach every other's buffer?
            infos: list = [None] * world
            dist.all_gather_object(infos, local_topology(device), group=group)
            problems = topology_problems(infos)
            if problems:
                shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more"
                                                   if len(problems) > 4 else "")
                raise ValueError(f"arfuse: Communicator: group of {world} ranks not supported: "
                                 f"{shown}. Nothing was allocated or opened.")
            ranks_per_device = max_ranks_per_gpu(infos)
        args = ("comm_create", rank, world, hidden, dtype, max_tokens,
                -1 if oneshot_max_tokens is None else oneshot_max_tokens, ranks_per_device,
                device, timeout_s)
        if world == 1:
            handle = _op(*args)
        else:
            handle = self._create_together(group, rank, world, args)
        self._init(handle)
        self.timeout_s = float(timeout_s)
        self._has_peers, self._peer_group = self._peers(group, world)
        if pdl:
            self.pdl = pdl

    @staticmethod
    def _create_together(group, rank: int, world: int, args: tuple) -> int:
        """comm_create on every rank, then one exchange of (error, settings, card, IPC handle):
        where any rank failed to create (a hidden size or dtype with no kernel, a bad argument,
        no memory) or was created with other settings, every rank closes what it made and
        raises one ValueError naming that rank and the reason -- no rank is left waiting for a
        peer that gave up, and nothing stays allocated. Else every rank opens every peer's
        buffer, and a barrier follows before anyone launches into them."""
        import torch.distributed as dist

        handle, error, settings, card, ipc = None, None, None, None, None
        try:
            handle = _op(*args)
            # Peers write into each other's buffers at offsets computed from their own
            # settings: every rank must have the same ones (else out-of-bounds writes).
            info = torch.ops.arfuse.comm_info(handle)
            settings = {"world_size": info[1], "hidden": info[2],
                        "dtype": str(_vocab.TORCH_DTYPES[info[3]]),
                        "max_tokens": info[4], "oneshot_max_tokens": info[5],
                        "slot_elems": info[9], "auto_oneshot_max_tokens": info[11]}
            card = torch.cuda.get_device_name(info[7])
            ipc = torch.ops.arfuse.comm_ipc_handle(handle).tolist()
        except Exception as e:  # noqa: BLE001 -- told to every rank below, then raised
            error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        try:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, (error, settings, card, ipc), group=group)
            failed = [(peer, err) for peer, (err, _, _, _) in enumerate(gathered) if err]
            if failed:
                shown = "; ".join(f"rank {peer}: {err}" for peer, err in failed[:4])
                raise ValueError(f"arfuse: Communicator: creation failed on {len(failed)} of "
                                 f"{world} ranks ({shown}); every rank refuses. Nothing was "
                                 "left allocated or opened.")
            for peer, (_, theirs, their_card, _) in enumerate(gathered):
                for key, value in settings.items():
                    if theirs[key] == value:
                        continue
                    if key == "auto_oneshot_max_tokens":
                        # Each rank reads its own card's dispatch rows: ranks that disagree
                        # would run different algorithms for one call (a timeout, not a sum).
                        raise ValueError(
                            f"arfuse: Communicator: rank {peer} ({their_card}) would run "
                            f"one-shot for T <= {theirs[key]}, rank {rank} ({card}) for "
                            f"T <= {value}: the one-shot/two-shot rows of their cards differ "
                            "(variants/tuning.yaml card_thresholds); every rank of a group must "
                            "run on the same kind of card. Nothing was left allocated or opened.")
                    raise ValueError(
                        f"arfuse: Communicator: rank {peer} was created with {key}="
                        f"{theirs[key]}, rank {rank} with {value}: every rank of the group "
                        "must pass the same max_tokens, hidden, dtype and oneshot_max_tokens. "
                        "Nothing was left allocated or opened.")
            handles = [h for _, _, _, h in gathered]
            try:
                _op("comm_open_peers", handle, torch.tensor(handles, dtype=torch.uint8))
                error = None
            except Exception as e:  # noqa: BLE001 -- told to every rank below, then raised
                error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            # Every rank has opened every peer before anyone launches into them (the gather is
            # the barrier), or every rank learns which could not.
            opened: list = [None] * world
            dist.all_gather_object(opened, error, group=group)
            failed = [(peer, err) for peer, err in enumerate(opened) if err]
            if failed:
                shown = "; ".join(f"rank {peer}: {err}" for peer, err in failed[:4])
                raise ValueError(f"arfuse: Communicator: opening the peers' buffers failed on "
                                 f"{len(failed)} of {world} ranks ({shown}); every rank refuses. "
                                 "Nothing was left allocated or opened.")
        except BaseException:
            if handle is not None:
                torch.ops.arfuse.comm_destroy(handle)
            raise
        return handle

    @staticmethod
    def _peers(group, world: int) -> tuple[bool, object]:
        """(whether peers in other processes write into this rank's buffer, the group close()
        waits for them on). group None is the default group, which barrier() takes as None too."""
        return world > 1, group

    @classmethod
    def _from_handle(cls, handle: int) -> "Communicator":
        self = cls.__new__(cls)
        self._init(handle)
        return self

    def _init(self, handle: int) -> None:
        info = torch.ops.arfuse.comm_info(handle)
        self._handle = handle
        # Emulated groups (LocalGroup): every rank is in this process, comm_destroy's device sync
        # waits for all of them.
        self._has_peers, self._peer_group = False, None
        self.rank, self.world_size, self.hidden = info[0], info[1], info[2]
        self.dtype = _vocab.TORCH_DTYPES[info[3]]
        self.max_tokens, self.oneshot_max_tokens = info[4], info[5]
        self.ranks_per_device = info[6]
        self.device = torch.device("cuda", info[7]) if info[7] >= 0 else torch.device("cpu")

    @property
    def buffer_bytes(self) -> int:
        """Bytes of this rank's Lamport buffer, allocated with cudaMalloc outside torch's
        allocator: three slots of the rows the larger algorithm it accepts needs (one-shot N *
        oneshot_max_tokens, two-shot about 2 * max_tokens: rows_per_slot in
        csrc/arfuse/protocol.h, read back through comm_info); 0 at world size 1."""
        info = torch.ops.arfuse.comm_info(self.handle)
        return NUM_SLOTS * int(info[9]) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def auto_oneshot_max_tokens(self) -> int:
        """algorithm="auto" runs one-shot for T <= this, where both algorithms are built for the
        combination (else the one that is): the row measured on this device's card
        (variants/tuning.yaml card_thresholds), else the default table's, else the default rule,
        capped by oneshot_max_tokens. 0 at world size 1 (the local algorithm)."""
        return int(torch.ops.arfuse.comm_info(self.handle)[11])

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise ValueError("arfuse: comm: this Communicator is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def status(self) -> int:
        """0 when healthy; 1 + r after a call gave up waiting for rank r."""
        return _op("comm_status", self.handle)

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (off at creation). When on, the fused kernels launch with
        CUDA's programmatic stream serialization: the grid may start while the kernel before it on
        the stream (the experts' GEMM, say) is still finishing, and every block waits for that
        kernel's completion before its first global memory access, so the results are those of
        plain stream order; what it saves is the launch gap between the two kernels (CUDA graphs
        keep it as a programmatic edge). CUDA communicators only: setting it on a CPU one raises
        ValueError."""
        return bool(torch.ops.arfuse.comm_info(self.handle)[10])

    @pdl.setter
    def pdl(self, enable: bool) -> None:
        if not isinstance(enable, bool):
            raise TypeError(f"arfuse: pdl: want a bool, got {type(enable).__name__}")
        _op("comm_set_pdl", self.handle, enable)

    def close(self, *, wait_for_peers: bool = True) -> None:
        """Frees the buffers. Closing twice is harmless.

        With peers in other processes, close() is collective, like the constructor: the rank
        waits for its own GPU, then for every peer at a barrier of the group, and only then frees.
        A peer's kernels still queued write into this rank's buffer through their IPC mapping,
        and memory freed under them could be handed to the next allocation (a new Communicator's
        buffer, which would take their late writes for data). wait_for_peers=False frees after
        the local wait only: for a rank leaving after an error, whose peers may never reach the
        barrier (leaving a `with` block by an exception does this)."""
        if getattr(self, "_handle", None) is None:
            return
        if wait_for_peers and getattr(self, "_has_peers", False):
            import torch.distributed as dist

            if dist.is_initialized():
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dist.barrier(group=self._peer_group)
        torch.ops.arfuse.comm_destroy(self._handle)
        self._handle = None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(wait_for_peers=exc_type is None)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"handle={self._handle}"
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, hidden={self.hidden}, "
                f"dtype={self.dtype}, max_tokens={self.max_tokens}, device={self.device}, {state})")


def local_communicator(*, max_tokens: int, hidden: int, dtype: torch.dtype,
                       device=None, pdl: bool = False) -> Communicator:
    """A communicator of world size 1, needing no process group: single-GPU serving. There is no
    all-reduce, so the op runs the local algorithm (one kernel: finalize + shared add + residual
    + RMSNorm, or an FP8 output) and the communicator allocates nothing (no peers, no buffer).
    device: a CUDA device (default: the current one), or "cpu" for the PyTorch implementation in
    arfuse._cpu (the same definition, for graph rewrites and tests without a GPU). pdl: see
    Communicator.pdl (CUDA only)."""
    _lib.require()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    handle = _op("comm_create", 0, 1, hidden, dtype, max_tokens, -1, 1, torch.device(device),
                 10.0)
    comm = Communicator._from_handle(handle)
    if pdl:
        try:
            comm.pdl = pdl
        except BaseException:
            comm.close()
            raise
    return comm


def cpu_communicator(*, max_tokens: int, hidden: int, dtype: torch.dtype) -> Communicator:
    """A world-size-1 communicator on the CPU: local_communicator(device="cpu"); the op runs the
    PyTorch implementation in arfuse._cpu (used to test graph rewrites without a GPU)."""
    return local_communicator(max_tokens=max_tokens, hidden=hidden, dtype=dtype, device="cpu")
