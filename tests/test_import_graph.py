"""The package's import graph has no cycles between modules, lazy and type-only imports
included (import-linter's contracts check the directions between packages)."""

from __future__ import annotations

import grimp


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles_between_modules() -> None:
    graph = grimp.build_graph("pagedserve", include_external_packages=False)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_package_module_over_400_lines() -> None:
    """Small modules with one owner each: the package's own code stays under 400 lines a file
    (tests and benchmark scripts aside)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    skip = {"tests", "docs", "deploy", "build"}
    long = {
        str(rel): n
        for p in root.rglob("*.py")
        if (rel := p.relative_to(root)).parts[0] not in skip
        and rel.parts[:2] != ("benchmarks", "scripts")
        and not any(part.startswith(".") for part in rel.parts)
        and (n := len(p.read_text(encoding="utf-8").splitlines())) > 400
    }
    assert long == {}
