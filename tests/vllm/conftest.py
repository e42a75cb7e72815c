"""Fixtures shared by the vLLM pass tests."""

from __future__ import annotations

import pytest
import torch

from arfuse.comm import cpu_communicator

MAX_TOKENS = 64  # the communicators' capacity in the pass tests (their MAX_TOKENS)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def comms():
    """make(spec, dtype, max_tokens) -> a world-size-1 CPU communicator, closed after the test."""
    made = []

    def make(spec, dtype=torch.bfloat16, max_tokens=MAX_TOKENS):
        comm = cpu_communicator(max_tokens=max_tokens, hidden=spec.hidden, dtype=dtype)
        made.append(comm)
        return comm

    yield make
    for c in made:
        c.close()
