#!/usr/bin/env python3
"""Finds import circles between the top-level modules of a crate or of the Python
package, and files too long.

A module `a` of a crate depends on `b` when code in `a` (not its tests, not comments)
names `crate::b`; a module of the Python package when it imports `.b` or `embank.b`
(imports under `if TYPE_CHECKING:` excepted: they run only for the type checker).
Prints every circle (a strongly connected component of more than one module) and every
source file over the line limit; exits 1 if there is any.

    python3 tools/import_cycles.py [SRC ...] [--lines-max 800]     (default: every crate's src)
"""

import argparse
import ast
import re
import sys
from pathlib import Path

CRATE_PATH = re.compile(r"\bcrate::(\w+)")
USE_GROUP = re.compile(r"\buse\s+crate::\{([^}]*)\}", re.S)
TESTS_START = re.compile(r"^#\[cfg\(test\)\]\s*\n\s*mod\s+\w+", re.M)


def module_of(src: Path, file: Path) -> str | None:
    parts = file.relative_to(src).parts
    if parts == ("lib.rs",) or parts == ("main.rs",):
        return None
    return parts[0].removesuffix(".rs")


def code_of(text: str) -> str:
    """The file's text without its test module and without comments."""
    m = TESTS_START.search(text)
    if m:
        text = text[: m.start()]
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def dependencies(src: Path) -> dict[str, set[str]]:
    deps: dict[str, set[str]] = {}
    for file in sorted(src.rglob("*.rs")):
        module = module_of(src, file)
        if module is None:
            continue
        code = code_of(file.read_text())
        names = set(CRATE_PATH.findall(code))
        for group in USE_GROUP.findall(code):
            names.update(re.findall(r"(?:^|[,{\s])(\w+)(?:::|\s*[,}]|\s*$)", group))
        deps.setdefault(module, set()).update(n for n in names if n != module)
    modules = set(deps)
    return {m: {d for d in ds if d in modules} for m, ds in deps.items()}


def python_dependencies(pkg: Path) -> dict[str, set[str]]:
    """The Python package's top-level modules and the siblings each imports."""
    modules = {p.stem for p in pkg.glob("*.py")} | {p.name for p in pkg.iterdir() if (p / "__init__.py").exists()}
    deps: dict[str, set[str]] = {}
    for file in sorted(pkg.glob("*.py")):
        found: set[str] = set()

        def visit(node: ast.AST) -> None:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for n in node.orelse:
                    visit(n)
                return
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
                elif node.level == 0 and node.module and node.module.startswith(pkg.name + "."):
                    found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith(pkg.name + "."))
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(file.read_text()))
        deps[file.stem] = {m for m in found if m in modules and m != file.stem}
    return deps


def circles(deps: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(deps[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="*")
    parser.add_argument("--lines-max", type=int, default=800)
    args = parser.parse_args()
    srcs = [Path(s) for s in args.src] or [*sorted(Path("crates").glob("*/src")), Path("python/embank")]
    failed = False
    for src in srcs:
        python = any(src.glob("*.py"))
        deps = python_dependencies(src) if python else dependencies(src)
        for component in circles(deps):
            failed = True
            edges = [f"{a} -> {b}" for a in component for b in sorted(deps[a]) if b in component]
            print(f"{src}: import circle among {', '.join(component)}: {'; '.join(edges)}")
        for file in sorted(src.rglob("*.py" if python else "*.rs")):
            lines = len(file.read_text().splitlines())
            if lines > args.lines_max:
                failed = True
                print(f"{file}: {lines} lines, over {args.lines_max}")
    if not failed:
        print(f"import circles and file lengths: none in {', '.join(map(str, srcs))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
