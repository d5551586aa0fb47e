"""The driver (fttree/net/) changes a worker's state only through `Replica.step`: it never moves
the life cycle, never writes a field of the replica or of its machines, and calls on them only
queries that read. A decision that creeps back into the driver fails here, by file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import fttree.net

NET = Path(fttree.net.__file__).parent
#: names under which the driver reaches the replica or a part of it (attributes or locals)
OWNED = frozenset({"replica", "machine", "membership", "admission", "life", "farewell"})
#: what the driver may call on them: `step`, the entrance, and queries that change nothing
QUERIES = frozenset({"step", "alive", "is_stale", "may_send", "waiting_for", "early_limit", "start_settled", "asked",
                     "status", "footprint", "computing", "neighbours"})


def _reaches_owned(node: ast.expr) -> bool:
    """Does `node` (an attribute chain, with calls and indexing) go through the replica?"""
    while True:
        if isinstance(node, ast.Attribute):
            if node.attr in OWNED:
                return True
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return isinstance(node, ast.Name) and node.id in OWNED


def _written(target: ast.expr) -> list[ast.expr]:
    """The places an assignment target writes (tuples unpacked)."""
    if isinstance(target, ast.Tuple | ast.List):
        return [t for elt in target.elts for t in _written(elt)]
    if isinstance(target, ast.Starred):
        return _written(target.value)
    return [target]


def violations(source: str, name: str) -> list[str]:
    """Every place in `source` that writes replica state or calls more than a query on it."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in (t for raw in targets for t in _written(raw)):
            # `self.replica = ...` names it; `self.replica.x = ...` or `replica.x[k] = ...` writes it
            if isinstance(target, ast.Attribute | ast.Subscript) and _reaches_owned(target.value):
                found.append(f"{name}:{node.lineno}: writes {ast.unparse(target)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _reaches_owned(node.func.value) \
                and node.func.attr not in QUERIES:
            found.append(f"{name}:{node.lineno}: calls {ast.unparse(node.func)}")
    return found


def test_no_driver_module_writes_the_replicas_state() -> None:
    modules = sorted(NET.glob("*.py"))
    assert any(p.name == "node.py" for p in modules), NET
    found = [v for path in modules for v in violations(path.read_text(), f"fttree/net/{path.name}")]
    assert not found, "the driver changes the replica other than through Replica.step:\n" + "\n".join(found)


def test_the_check_sees_the_side_doors_it_forbids() -> None:
    """Each way the driver used to change the replica is caught (the check can fail)."""
    side_doors = {
        "self.life.on(Life.STOP)": "calls self.life.on",
        "replica.life.on(Life.GROUP_FOUND)": "calls replica.life.on",
        "self.replica.completed.append(step)": "calls self.replica.completed.append",
        "self.replica.farewell.due(last_submitted=1, pending=f, stopped=False)": "calls self.replica.farewell.due",
        "self.replica.admitted(view, 1, 2)": "calls self.replica.admitted",
        "self.replica.pending = ()": "writes self.replica.pending",
        "self.membership.user_step += 1": "writes self.membership.user_step",
        "replica.admission.candidates[3] = 7": "writes replica.admission.candidates[3]",
        "a, self.replica.early = 1, []": "writes self.replica.early",
        "del self.machine.held[4]": "writes self.machine.held[4]",
    }
    for line, said in side_doors.items():
        assert [v.split(": ", 1)[1] for v in violations(line, "x.py")] == [said], line
    allowed = "self.replica = replica\nself.replica.step(Connected(), now)\nreplica.admission.asked()\n" \
              "n = self.replica.membership.node_deadline_s\nself.steps.running[3] = run"
    assert violations(allowed, "x.py") == []


def _runtime_imports(tree: ast.Module) -> set[str]:
    """Modules a file imports when it runs (not those under `if TYPE_CHECKING:`, for types only)."""
    skipped = {id(n) for stmt in tree.body if isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name)
               and stmt.test.id == "TYPE_CHECKING" for n in ast.walk(stmt)}
    return {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in skipped}


def test_the_node_needs_neither_machine_to_run() -> None:
    """The node drives the replica: it needs the events, actions and status types, which live in
    modules of their own, and never the tree machine's or the membership's code (issue 43)."""
    imports = _runtime_imports(ast.parse((NET / "node.py").read_text()))
    assert "core.replica" in imports  # (it reads relative imports as their module's name)
    forbidden = {"core.protocol", "core.membership"}
    assert not {m for m in imports if m.lstrip(".") in forbidden}, sorted(imports)
    typed = ast.parse("if TYPE_CHECKING:\n    from ..core.protocol import TreeMachine\nfrom ..core.protocol import X\n")
    assert _runtime_imports(typed) == {"core.protocol"}  # the check tells the two apart
