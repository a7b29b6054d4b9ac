"""What `pip install titan_muon` asks for, and what `import titan_muon` needs.

The core (optimizer, MuonClip, Split, param groups) needs torch alone; the TorchTitan adapter,
the plots and the test tools come through extras (pyproject.toml, docs/torchtitan.md#compatibility).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "titan_muon"
ADAPTER = PACKAGE / "torchtitan"
# Distributions that the core must never import, and that a core-only install does not have.
EXTRA_ONLY = ("torchtitan", "tensorboard", "matplotlib", "datasets", "tokenizers", "triton", "torchao")


def project() -> dict:
    with open(REPO / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]


def requirements(entries: list[str]) -> dict[str, Requirement]:
    parsed = [Requirement(entry) for entry in entries]
    return {canonical(requirement.name): requirement for requirement in parsed}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def third_party_imports(files: list[Path]) -> dict[str, set[str]]:
    """Top-level modules imported anywhere in ``files`` (inside functions too), minus the
    standard library and titan_muon itself, each with the files that import it."""
    found: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top != "titan_muon":
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def core_files() -> list[Path]:
    # titan_muon/train.py is the launcher's alias: `python -m titan_muon.train` needs the extra,
    # `import titan_muon` never imports it.
    return [
        path for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "train.py" and ADAPTER not in path.parents
    ]  # fmt: skip


def test_core_depends_on_torch_alone_with_no_upper_bound():
    core = requirements(project()["dependencies"])
    assert list(core) == ["torch"]
    torch = core["torch"]
    assert torch.marker is None and not torch.extras
    assert torch.specifier.contains("2.13.0")
    assert not torch.specifier.contains("2.12.1"), "2.13 is the oldest torch tested"
    for newer in ("2.14.1", "2.15.0", "3.0.0"):
        assert torch.specifier.contains(newer), f"torch {newer} is refused: {torch}"


def test_extras():
    extras = {name: requirements(entries) for name, entries in project()["optional-dependencies"].items()}
    assert {"torchtitan", "plots", "test"} <= set(extras)
    torchtitan = extras["torchtitan"]["torchtitan"].specifier
    assert torchtitan.contains("0.2.2") and torchtitan.contains("0.3.0") and torchtitan.contains("0.3.5")
    assert not torchtitan.contains("0.2.1") and not torchtitan.contains("0.4.0")
    assert "matplotlib" in extras["plots"]
    assert {"pytest", "pytest-timeout", "expecttest"} <= set(extras["test"])
    assert "matplotlib" not in extras["torchtitan"], "training does not plot"


# Optional kernels the core uses where they are installed (docs/newton_schulz.md): imported only
# inside a try block that falls back to torch, so the core still needs torch alone.
OPTIONAL_KERNELS = {"gram_newton_schulz", "quack"}


def _imports_outside_try(path: Path, modules: set[str]) -> list[int]:
    """Lines of `path` importing one of `modules` outside the body of a try statement."""
    tree = ast.parse(path.read_text(), str(path))
    guarded = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.Try) for stmt in node.body for inner in ast.walk(stmt)}
    lines = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if any(name.partition(".")[0] in modules for name in names) and id(node) not in guarded:
            lines.append(node.lineno)
    return lines


def test_core_modules_import_only_torch():
    """Static half of the check below: no core module names a third-party module but torch
    (and the optional kernels, each only inside a try block), and none imports the adapter."""
    imports = third_party_imports(core_files())
    assert set(imports) - OPTIONAL_KERNELS == {"torch"}
    for path in core_files():
        assert not _imports_outside_try(path, OPTIONAL_KERNELS), path
    for path in core_files():
        assert "titan_muon.torchtitan" not in path.read_text().replace("titan_muon/torchtitan", ""), path


def test_every_module_the_adapter_imports_comes_with_the_torchtitan_extra():
    import titan_muon.torchtitan

    extra = requirements(project()["optional-dependencies"]["torchtitan"])
    imported = third_party_imports(sorted(ADAPTER.rglob("*.py")))
    missing = {name: files for name, files in imported.items() if name != "torch" and canonical(name) not in extra}
    assert not missing, f"imported by the adapter but not in the torchtitan extra: {missing}"
    # The names the adapter's import error recognizes are in the extra as well.
    assert {canonical(name) for name in titan_muon.torchtitan.EXTRA_MODULES} <= set(extra)


def test_pinned_versions_lie_in_the_declared_ranges():
    pins = requirements([line for line in (REPO / "constraints.txt").read_text().splitlines() if line.strip() and not line.startswith("#")])
    declared = requirements(project()["dependencies"])
    for entries in project()["optional-dependencies"].values():
        declared.update(requirements(entries))
    for name, pin in pins.items():
        assert str(pin.specifier).startswith("=="), f"constraints.txt pins exact versions: {pin}"
        if name in declared:
            version = str(pin.specifier)[2:]
            assert declared[name].specifier.contains(version), f"constraints.txt {pin} outside pyproject's {declared[name]}"


BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Missing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, Missing())
    """
)


def run_without(modules: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code), ",".join(modules)],
        capture_output=True, text=True, timeout=240, cwd=REPO, check=False,
    )  # fmt: skip


def test_the_core_works_without_any_extra():
    """Every core module imports, and Muon steps, with every extra's modules missing."""
    result = run_without(
        EXTRA_ONLY,
        """
        import importlib, pkgutil
        import torch
        import titan_muon
        from titan_muon import Muon, build_param_groups

        core = [
            m.name for m in pkgutil.walk_packages(titan_muon.__path__, "titan_muon.")
            if not m.name.startswith(("titan_muon.torchtitan", "titan_muon.train"))
        ]
        expected = {"titan_muon.optimizer", "titan_muon.attention.clip", "titan_muon.attention.split", "titan_muon.param_groups"}
        assert expected <= set(core), core
        for name in core:
            importlib.import_module(name)

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        before = [p.detach().clone() for p in model.parameters()]
        opt = Muon(build_param_groups(model, adamw_lr=1e-3), lr=0.02)
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        loaded = sorted({m.partition(".")[0] for m in sys.modules} & BLOCKED)
        assert not loaded, loaded
        print("core ok")
        """,
    )
    assert result.returncode == 0 and "core ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("module", ["torchtitan", "datasets", "triton"])
def test_the_adapter_without_its_extra_names_the_extra(module):
    result = run_without((module,), "import titan_muon.torchtitan")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: titan_muon.torchtitan needs ") and '".[torchtitan]"' in last, last


def test_torchtitan_versions_the_adapter_accepts():
    from titan_muon.torchtitan import check_torchtitan_version

    for version in ("0.2.2", "0.2.3", "0.2.2.dev20260101+cpu", "0.3.0", "0.3.1"):
        check_torchtitan_version(version)
    for version in ("0.4.0", "0.1.0", "1.0", "unknown"):
        with pytest.raises(ImportError, match="torchtitan==0.2.2"):
            check_torchtitan_version(version)


def test_pyproject_says_which_torchtitan_versions_train():
    """The comment over the torchtitan extra tells what check_torchtitan_version does: every
    minor version it accepts trains (test_torchtitan_versions_the_adapter_accepts), the others
    are refused at import. It once said 0.3.x was refused while 0.3.0 trained."""
    from titan_muon.torchtitan import SUPPORTED

    text = (REPO / "pyproject.toml").read_text()
    comment = " ".join(line.lstrip("# ") for line in text.split("torchtitan = [")[0].splitlines()[-6:] if line.startswith("#"))
    for major, minor in SUPPORTED:
        assert f"{major}.{minor}." in comment, f"pyproject.toml's torchtitan comment should name {major}.{minor}"
    assert "Both minor versions train" in comment and "Any other version is refused at import" in comment


def test_titan_muon_train_is_an_alias_of_the_launcher():
    import titan_muon.torchtitan.train
    import titan_muon.train

    assert titan_muon.train.Trainer is titan_muon.torchtitan.train.Trainer
    assert titan_muon.train.run is titan_muon.torchtitan.train.run
