"""The contract table (arfuse/vllm/contract/) against the installed vLLM, and the table against
arfuse's own code: every `vllm` import and every vLLM op name under arfuse/vllm/ and
arfuse_vllm_pass.py must be an item, so the static check (scripts/vllm_contract.py) checks what
the code really uses."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vllm_harness as H

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted((REPO / "arfuse" / "vllm").rglob("*.py")) + [REPO / "arfuse_vllm_pass.py"]


def _items():
    from arfuse.vllm import contract

    return contract


def uses(path: Path) -> list[tuple[str, str, str]]:
    """(kind, module or op, name) of what `path` takes from vLLM: imports (module level or in
    functions), op names as strings ("vllm::x"), torch.ops.<vllm ns>.<op> attribute chains."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            out += [("import", node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [("import", a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            ns = node.value.split("::")[0]
            if "::" in node.value and ns in ("vllm", "vllm_ir", "_C") and " " not in node.value:
                out.append(("op", node.value, ""))
        elif isinstance(node, ast.Attribute):
            text = ast.unparse(node)
            parts = text.split(".")
            if len(parts) == 4 and parts[:2] == ["torch", "ops"] and parts[2] in (
                    "vllm", "vllm_ir", "_C"):
                out.append(("op", f"{parts[2]}::{parts[3]}", text))
    return out


def covered(contract, kind: str, module: str, name: str) -> bool:
    for item in contract.ITEMS:
        if kind == "op":
            if item.kind == "op" and item.name == module:
                return True
            if item.kind == "op_ref" and item.name == f"torch.ops.{module.replace('::', '.')}":
                return True
            continue
        if not name:  # `import vllm.x.y`: the module itself, or any item in it or below
            if item.module == module or item.module.startswith(module + "."):
                return True
            continue
        if item.module == module and (item.name == name or item.name.startswith(name + ".")):
            return True
        if item.module == f"{module}.{name}":  # `from vllm.ir import ops`
            return True
    return False


def test_every_vllm_use_is_in_the_table():
    contract = _items()
    missing = [
        f"{path.relative_to(REPO)}: {kind} {module} {name}".rstrip()
        for path in SOURCES
        for kind, module, name in uses(path)
        if not covered(contract, kind, module, name)
    ]
    assert not missing, "not in arfuse/vllm/contract ITEMS:\n" + "\n".join(missing)


def test_the_grep_sees_the_uses():
    """The scan finds what fusion.py and plugin.py are known to use (so an empty result above
    means covered, not unseen)."""
    found = {(k, m, n) for p in SOURCES for k, m, n in uses(p)}
    assert ("import", "vllm.compilation.passes.inductor_pass", "InductorPass") in found
    assert ("import", "vllm.config", "VllmConfig") in found
    assert ("op", "vllm_ir::fused_add_rms_norm", "") in found
    assert any(k == "op" and n == "torch.ops.vllm.all_reduce.default" or m == "vllm::all_reduce"
               for k, m, n in found)


def test_installed_vllm_has_what_the_integration_needs():
    vllm = H.require_vllm()
    contract = _items()
    from arfuse.vllm.contract.installed import check_installed

    results = check_installed()
    assert vllm.__version__ in contract.SUPPORTED
    assert contract.summarize(results) == []
    by_key = {r.item.key: r for r in results}
    # The cache key hook target of this release, found by import and inspect.
    hashes = by_key["hook.cache_key.compute_hash"], by_key["hook.cache_key.compile_factors"]
    assert [r.status != "missing" for r in hashes].count(True) == 1, hashes
    assert by_key["op.all_reduce"].how == "import"
    assert by_key["op.all_reduce"].status == "ok"
    assert by_key["hook.worker"].how == "source"


def test_static_and_installed_checks_agree():
    """The AST check (what scripts/vllm_contract.py runs on wheels) on the installed vLLM's own
    files gives the same verdict as import/inspect, item by item."""
    H.require_vllm()
    from arfuse.vllm import contract
    from arfuse.vllm.contract import installed as by_import
    from arfuse.vllm.contract import source

    root = by_import._installed_source_root()
    index = source.Index(source.DirSource(root))
    differ = []
    for item in contract.ITEMS:
        static = source.check(index, item)
        installed = by_import.check_item(item)
        if static.status != installed.status:
            differ.append(f"{item.key}: static {static.status} {static.detail} / installed "
                          f"{installed.status} {installed.detail} ({installed.how})")
    assert not differ, "\n".join(differ)


@pytest.mark.parametrize("key", ["hook.configure", "op.moe_forward", "slot.resolution"])
def test_the_check_can_fail(key):
    """A changed item is reported: the same item with other expectations is not ok."""
    H.require_vllm()
    import dataclasses

    from arfuse.vllm import contract
    from arfuse.vllm.contract.installed import check_item

    item = contract.BY_KEY[key]
    if item.kind == "code":
        changed = dataclasses.replace(item, fragments=("no_such_call(",))
    else:
        changed = dataclasses.replace(item, params=("self", "no_such_parameter"))
    result = check_item(changed)
    assert result.status == "changed"
    # strict items and code fragments fail the check; a plain signature change is reported only
    assert bool(contract.summarize([result])) == (changed.strict or changed.kind == "code")
    gone = dataclasses.replace(item, name=item.name + "_gone" if item.kind != "op"
                               else item.name + "_gone")
    assert check_item(gone).status == "missing"
    assert contract.summarize([check_item(gone)])
