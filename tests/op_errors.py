"""What a direct torch.ops.arfuse.* call raises for a bad argument.

The library is built on the PyTorch stable ABI, whose kernels can raise RuntimeError only; the
kind of error comes first in the message ("ValueError: arfuse: ...", csrc/host/errors.h) and the
public Python API re-raises it as that kind (arfuse._lib.reraise). Tests of the public API assert
ValueError / TypeError directly; tests of the raw ops use op_raises.
"""

from __future__ import annotations

import contextlib
import re

import pytest

from arfuse import _lib


@contextlib.contextmanager
def op_raises(kind: type[Exception], match: str):
    """The block raises RuntimeError("<kind>: arfuse: ...") whose first line matches `match`,
    and the public API's translation of it is a `kind`."""
    with pytest.raises(RuntimeError) as e:
        yield e
    first = str(e.value).splitlines()[0]
    assert first.startswith(f"{kind.__name__}: arfuse: "), first
    assert re.search(match, first), first
    typed = _lib.typed(e.value)
    assert type(typed) is kind and str(typed) == first[len(kind.__name__) + 2:]
