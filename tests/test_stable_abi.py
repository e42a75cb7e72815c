"""The op library is built on the PyTorch stable ABI: it imports torch's C shims only, never
torch's C++ API, so one build loads under torch 2.11 and later releases (docs/design.md,
"One library for several torch releases"). These tests read the ELF file of the library under
test; they need binutils (nm, readelf), which the build needs anyway."""

from __future__ import annotations

import re
import shutil
import subprocess

from arfuse import _lib

# A C++ symbol of torch's own namespaces, demangled (c10::, at::, torch::, caffe2::).
CXX_TORCH = re.compile(r"(^|[^A-Za-z0-9_])(c10|at|torch|caffe2)::")


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} (binutils) is not on PATH"
    return path


def undefined_symbols(path: str) -> list[str]:
    out = subprocess.run([tool("nm"), "-D", "--undefined-only", "--demangle", path],
                         check=True, capture_output=True, text=True).stdout
    # "                 U name": the kind letter, then the (demangled) name.
    return [line.strip().split(None, 1)[1] for line in out.splitlines() if line.strip()]


def needed(path: str) -> list[str]:
    out = subprocess.run([tool("readelf"), "-d", path], check=True, capture_output=True,
                         text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def test_imports_no_torch_cxx_symbols():
    symbols = undefined_symbols(_lib.library_path())
    bad = [s for s in symbols if CXX_TORCH.search(s)]
    assert not bad, f"{len(bad)} symbols of torch's C++ API imported, e.g. {bad[:3]}"
    assert any(s.startswith("aoti_torch_") for s in symbols), "no C shim imported: wrong file?"


def test_links_torch_shims_and_the_shared_cudart():
    libs = needed(_lib.library_path())
    # The shims live in libtorch_cpu / libtorch_cuda; without them as NEEDED the load fails
    # ("undefined symbol: aoti_torch_library_init_fragment").
    assert {"libtorch_cpu.so", "libtorch_cuda.so"} <= set(libs), libs
    # torch's C++ libraries of one release are not needed: c10 is what changes between them.
    assert not [x for x in libs if x.startswith(("libc10", "libtorch_python"))], libs
    # The CUDA runtime torch loaded (one per process), by its major-version soname.
    assert "libcudart.so.13" in libs, libs


def test_the_symbol_check_catches_a_cxx_import():
    """The pattern above matches what an ATen build imports (checked on its demangled form)."""
    for s in ("c10::detail::torchCheckFail(char const*, char const*, unsigned int, char const*)",
              "at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>)",
              "torch::Library::_def(c10::FunctionSchema&&, c10::OperatorName*, "
              "std::vector<at::Tag> const&, torch::_RegisterOrVerify) &"):
        assert CXX_TORCH.search(s), s
    for s in ("aoti_torch_get_dtype", "torch_call_dispatcher", "cudaMalloc", "memcpy"):
        assert not CXX_TORCH.search(s), s

