"""The Python package's modules form layers, as the Rust crates' do (`tests/layers.rs`):
each imports, at its top or inside a function, only the modules after it in the
`Module order:` line of `allocbox/__init__.py`, so that no two use each other. The
package's facade (`allocbox/__init__.py`) is left out: it imports its modules, and they
import it for what it offers everyone."""

import ast
import pathlib

PYTHON = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = PYTHON / "allocbox"


def module_order():
    for line in (PACKAGE / "__init__.py").read_text().splitlines():
        if line.startswith("# Module order: "):
            return [name.strip() for name in line.removeprefix("# Module order: ").split(" > ")]
    raise AssertionError("allocbox/__init__.py has a `# Module order:` line")


def module_files():
    files = {path.stem: path for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    files.update({path.stem: path for path in PYTHON.glob("_allocbox_*.py")})
    return files


def imported(tree, known):
    """Each module of `known` the code imports, with the line, anywhere in it."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                name = parts[1] if parts[0] == "allocbox" and len(parts) > 1 else parts[0]
                if name in known:
                    yield name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            inside = node.level == 1 or node.module == "allocbox" or (node.module or "").startswith("allocbox.")
            if node.module and node.level == 0 and not node.module.startswith("allocbox"):
                if node.module in known:
                    yield node.module, node.lineno
                continue
            module = (node.module or "").removeprefix("allocbox").lstrip(".")
            if inside and module:
                name = module.split(".")[0]
                if name in known:
                    yield name, node.lineno
            elif inside:
                for alias in node.names:
                    if alias.name in known:
                        yield alias.name, node.lineno


def layer_violations(files, order):
    rank = {name: i for i, name in enumerate(order)}
    wrong = [f"{name}.py: not in the `Module order:` line" for name in sorted(files) if name not in rank]
    for name, path in sorted(files.items()):
        if name not in rank:
            continue
        for used, line in imported(ast.parse(path.read_text()), set(files)):
            if used != name and rank[used] <= rank[name]:
                wrong.append(f"{path.name}:{line}: `{name}` imports `{used}`, which is above it")
    return wrong


def test_every_module_of_the_package_imports_only_those_below_it():
    # Issue 65: `_allocbox_startup` -> `children` -> `numba` -> `_allocbox_startup`,
    # through imports inside functions; what both need is `_allocbox_hooks` of its own.
    files = module_files()
    assert {"run", "children", "numba", "_allocbox_startup", "_allocbox_hooks"} <= set(files)
    assert layer_violations(files, module_order()) == []


def test_an_import_inside_a_function_of_a_module_above_is_named(tmp_path):
    (tmp_path / "low.py").write_text("def f():\n    from . import high\n")
    (tmp_path / "high.py").write_text("from .low import f\n")
    files = {"low": tmp_path / "low.py", "high": tmp_path / "high.py"}
    assert layer_violations(files, ["high", "low"]) == ["low.py:2: `low` imports `high`, which is above it"]
