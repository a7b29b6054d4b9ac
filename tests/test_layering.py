"""The package's folders and top-level modules form layers: each imports only the layers below
it (function-level imports included), so no two folders import each other. The order is the
one docs/design.md's module map shows, top layer last here."""

import ast
import pathlib

import titan_muon

PACKAGE = pathlib.Path(titan_muon.__file__).parent

# lowest first; a name is a folder of titan_muon/ or a module directly in it ("__init__": the package)
LAYERS = [
    "base",
    "timing",
    "buffers",
    "algorithm",
    "param_groups",
    "attention",
    "settings",
    "exchange",
    "state",
    "step",
    "demo",
    "metrics",
    "checkpoint",
    "muon_math",
    "optimizer",
    "__init__",
    "torchtitan",
    "train",
]


def _unit(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imported_units(tree: ast.AST) -> set[str]:
    """The layers a module's titan_muon imports reach, anywhere in the module."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = node.module.split(".")
            if names[0] != "titan_muon":
                continue
            if len(names) > 1:
                found.add(names[1])
            else:  # from titan_muon import X: a module or folder of the package, else the package's own names
                found |= {a.name if (PACKAGE / a.name).exists() or (PACKAGE / f"{a.name}.py").exists() else "__init__"
                          for a in node.names}  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError("relative imports hide which layer they reach; import titan_muon.… by name")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names = alias.name.split(".")
                if names[0] == "titan_muon":
                    found.add(names[1] if len(names) > 1 else "__init__")
    return found


def test_every_folder_and_module_of_the_package_has_a_layer():
    units = {_unit(p) for p in PACKAGE.rglob("*.py")}
    assert units == set(LAYERS), (units - set(LAYERS), set(LAYERS) - units)


def test_each_layer_imports_only_the_layers_below_it():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(path)
        for target in _imported_units(ast.parse(path.read_text(), str(path))):
            if target != unit and rank[target] > rank[unit]:
                upward.append(f"{path.relative_to(PACKAGE.parent)} ({unit}) imports {target}")
    assert not upward, "imports that reach up a layer:\n" + "\n".join(upward)


def test_the_package_never_imports_the_tools_beside_it():
    """scale_replay/ (the replay), tests/ and scripts/ sit above the package; a user's install has none."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []  # fmt: skip
            found += [f"{path.relative_to(PACKAGE.parent)} imports {m}" for m in modules
                      if m.split(".")[0] in ("scale_replay", "tests", "scripts")]  # fmt: skip
    assert not found, found


def test_the_layer_check_sees_an_upward_import():
    """The check itself: a ground-floor module importing the exchange is reported."""
    tree = ast.parse("def f():\n    from titan_muon.exchange.plan import Unit\n")
    assert _imported_units(tree) == {"exchange"}
    tree = ast.parse("from titan_muon import Muon, settings\nimport titan_muon.step.commit\n")
    assert _imported_units(tree) == {"__init__", "settings", "step"}
