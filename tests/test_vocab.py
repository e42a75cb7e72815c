"""arfuse/_vocab.py against the compiled library: the positions it gives dtypes, algorithms and
output kinds are the values the C++ ops use, and its limits are the built plan's. (Its rows are
arfuse/_vocab_tables.py, generated from the Go tables: go test ./gen checks what the generator
prints, TestVocabPython, and that the checked-in file is current, as gen --check does.)"""

import torch

from arfuse import _vocab


def test_dtype_positions_are_the_libraries(lib):
    from arfuse.comm import cpu_communicator

    for i, (name, dtype) in enumerate(_vocab.DTYPES.items()):
        comm = cpu_communicator(max_tokens=4, hidden=128, dtype=dtype)
        try:
            assert torch.ops.arfuse.comm_info(comm.handle)[3] == i, name
            assert comm.dtype is dtype is _vocab.TORCH_DTYPES[i]
            assert _vocab.DTYPE_NAME_OF[dtype] == name
        finally:
            comm.close()


def test_algorithm_and_output_values_reach_the_dispatch_table(lib, manifest):
    """Every instance of the build is found by instance_for under the names _vocab gives its
    dtype, algorithm and output kind (a wrong value would find another instance, or none)."""
    insts = manifest["instances"]
    specialised = {(i["dtype"], i["hidden"]) for i in insts if not i["generic"]}
    assert {i["output"] for i in insts} <= set(_vocab.OUTPUTS)
    assert {i["algorithm"] for i in insts} == \
        set(_vocab.KERNEL_ALGORITHMS) | set(_vocab.LOCAL_ALGORITHMS)
    for inst in insts:
        dtype = _vocab.DTYPES[inst["dtype"]]
        if inst["generic"]:
            hidden = 3072  # a multiple of 128 that this build does not specialise
            assert (inst["dtype"], hidden) not in specialised
            world = 1 if inst["algorithm"] in _vocab.LOCAL_ALGORITHMS else 2
        else:
            hidden, world = inst["hidden"], inst["world_size"]
        # A token split's twin serves T <= max_tokens; the rest serve every T (None).
        got = lib.instance_for(dtype, hidden, world, inst["algorithm"], inst["output"],
                               num_tokens=inst["max_tokens"] or None)
        assert got == inst["name"], (inst["name"], got)


def test_limits_are_the_built_plans(manifest):
    lim = _vocab.LIMITS
    sizes = {d["name"]: d["bytes"] for d in _vocab._TABLES["dtypes"]}
    generic = [i for i in manifest["instances"] if i["generic"]]
    assert generic
    for inst in generic:
        vec = lim["vector_bytes"] // sizes[inst["dtype"]]
        assert inst["plan"]["vec"] == vec
        assert inst["plan"]["max_hidden"] == lim["generic_max_threads"] * lim["max_vecs_per_thread"] * vec
    for inst in manifest["instances"]:
        assert inst["plan"]["vecs_per_thread"] <= lim["max_vecs_per_thread"]
        assert inst["world_size"] <= lim["max_world"]
        assert inst["hidden"] <= lim["max_hidden"]



def test_every_output_row_has_its_reference_quantizer():
    """An output kind is one row: arfuse/reference.py quantizes each row's kind, with the dtype
    and scale shape the row says (the fake implementations and the CPU ops follow the rows)."""
    from arfuse import reference

    assert set(reference.QUANTIZERS) == set(_vocab.OUTPUTS)
    T, H = 3, 256
    y = torch.randn(T, H)
    for name, row in _vocab.OUTPUT_ROWS.items():
        scale = torch.tensor([0.5]) if row["scales"] == "input" else None
        q, s = reference.quantize(name, y, fp8_scale=scale)
        want = _vocab.OUTPUT_DTYPES[name]
        assert (q.dtype == want) if want is not None else q is y, name
        shape = {"none": None, "input": None, "token": (T,), "group": (T, H // max(row["group"], 1))}
        assert (s is None) if shape[row["scales"]] is None else tuple(s.shape) == shape[row["scales"]], name
    assert _vocab.dynamic_kind(0) == "fp8_token" and _vocab.dynamic_kind(128) == "fp8_group128"
    assert _vocab.dynamic_kind(64) is None and _vocab.STATIC_KIND == "fp8_static"
