"""The peak of live tensor memory while some Python code runs, counted exactly, on the CPU.

`LiveBytes` is a TorchDispatchMode: every op the code runs passes through it. A storage that an
op's output holds and none of its inputs held (no view, no in-place result, no `set_` onto a
given storage) is a new allocation of `storage.nbytes()` bytes; a weakref.finalize on the
storage object takes them off when the storage itself is freed (PyTorch keeps one Python object
per storage for as long as the storage lives, so the finalizer fires with the last view gone,
not with the first Python reference). `peak` is the highest sum of such bytes live at once,
counted from zero at entry: what was allocated before (weights, inputs, vLLM's shared workspace
once grown) is not in it.

What it sees is what the GPU would allocate through PyTorch: the allocations of every op called
from Python, the outputs of the ops it does not open. Custom ops are opaque to a dispatch mode
(their kernels run below it); those named in `open_ops` (vLLM's MoE ops and arfuse's rows ops,
whose kernels are Python calling further ops) are run with the mode on inside, so what they
allocate counts too. Kernels that allocate nothing through PyTorch (Triton's interpreter works
in numpy on the tensors' own memory; the CUDA-op stand-ins of triton_cpu write into their
arguments) count as on the GPU: nothing, whatever scratch the stand-ins use in Python.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_BELOW_PYTHON = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


@dataclass
class Allocation:
    op: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


class LiveBytes(TorchDispatchMode):
    def __init__(self, open_ops: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.open_ops = open_ops
        self.live = 0
        self.peak = 0
        self.at_peak: list[Allocation] = []  # what was live at the peak
        self.allocated: list[Allocation] = []  # every allocation, in order
        self._live: dict[int, Allocation] = {}

    def _free(self, key: int) -> None:
        a = self._live.pop(key)
        self.live -= a.nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.name() in self.open_ops:
            with self:
                out = func.redispatch(_BELOW_PYTHON, *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        held = {id(x if isinstance(x, torch.UntypedStorage) else x.untyped_storage())
                for x in tree_leaves((args, kwargs))
                if isinstance(x, (torch.Tensor, torch.UntypedStorage))}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            if key in held or key in self._live:
                continue
            a = Allocation(func.name(), st.nbytes(), tuple(t.shape), str(t.dtype))
            self._live[key] = a
            self.allocated.append(a)
            weakref.finalize(st, self._free, key)
            self.live += a.nbytes
            if self.live > self.peak:
                self.peak = self.live
                self.at_peak = list(self._live.values())
        return out
