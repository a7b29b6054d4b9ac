"""docs/reference.md against the code, and the README against its limits.

docs/reference.md marks each table it promises to keep exact with ``<!-- checked: NAME -->``.
Every key such a table names must exist in the code, every key of the code must be in the table,
and each documented default must equal the code's (``==`` and the same type, so ``1`` is not
``1.0`` nor ``True``). The code is reached through what users name: ``titan_muon.Muon``,
``titan_muon.build_param_groups``, and the module that the reference tells torchtitan to load
(``custom_config_module``). One process, no collectives.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import inspect
import re
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_muon import Muon, build_param_groups

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference.md"
README = REPO / "README.md"
REQUIRED = "required"  # a default cell: the argument has no default
UNSET = "unset"  # a default cell: the key is absent (TOML) / not filled in (param groups)


# ------------------------------------------------------------------ reading the reference


def split_row(line: str) -> list[str]:
    """The cells of one markdown table row (``\\|`` inside a cell is not a separator)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def checked_tables(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """{table name: {key: (default cell, meaning cell)}} of the tables marked ``<!-- checked: NAME -->``."""
    lines = text.splitlines()
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    for index, line in enumerate(lines):
        marker = re.fullmatch(r"<!-- checked: ([\w-]+) -->", line.strip())
        if marker is None:
            continue
        name = marker[1]
        assert name not in tables, f"docs/reference.md marks two tables {name!r}"
        header, rule = split_row(lines[index + 1]), lines[index + 2]
        assert len(header) == 3 and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", rule.strip()), f"table {name!r}: key | default | meaning"
        rows: dict[str, tuple[str, str]] = {}
        for row in lines[index + 3 :]:
            if not row.startswith("|"):
                break
            cells = split_row(row)
            assert len(cells) == 3, f"table {name!r}: three cells per row, got {row!r}"
            key = re.fullmatch(r"`([^`\s]+)`", cells[0])
            assert key is not None, f"table {name!r}: a row's first cell is one `key`, got {cells[0]!r}"
            assert key[1] not in rows, f"table {name!r} lists {key[1]!r} twice"
            rows[key[1]] = (cells[1], cells[2])
        assert rows, f"table {name!r} is empty"
        tables[name] = rows
    return tables


@pytest.fixture(scope="module")
def tables() -> dict[str, dict[str, tuple[str, str]]]:
    return checked_tables(REFERENCE.read_text())


def code_span(cell: str, where: str) -> str:
    span = re.fullmatch(r"`([^`]+)`", cell)
    assert span is not None, f"{where}: the default is one `value` (or {REQUIRED!r}), got {cell!r}"
    return span[1]


def python_default(cell: str, where: str):
    """A documented Python default: ``required`` (no default), or a literal in a code span."""
    if cell == REQUIRED:
        return inspect.Parameter.empty
    text = code_span(cell, where)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pytest.fail(f"{where}: the default {text!r} is not a Python literal")


def toml_default(cell: str, where: str):
    """A documented TOML default: a TOML value in a code span, or `unset` (None)."""
    text = code_span(cell, where)
    if text == UNSET:
        return None
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        pytest.fail(f"{where}: the default {text!r} is not a TOML value")


def same(documented, actual) -> bool:
    """Equal and of the same type, elementwise for tuples and lists."""
    if isinstance(actual, (tuple, list)) and type(documented) is type(actual):
        return len(documented) == len(actual) and all(same(d, a) for d, a in zip(documented, actual))
    return type(documented) is type(actual) and documented == actual


def check_same_keys(documented, actual, what: str) -> None:
    missing, extra = sorted(set(actual) - set(documented)), sorted(set(documented) - set(actual))
    assert not missing, f"docs/reference.md lacks {what}: {missing}"
    assert not extra, f"docs/reference.md documents {what} the code does not have: {extra}"


def check_signature(rows: dict[str, tuple[str, str]], function, what: str) -> None:
    parameters = {name: p for name, p in inspect.signature(function).parameters.items() if name != "self"}
    check_same_keys(rows, parameters, what)
    for name, parameter in parameters.items():
        where = f"docs/reference.md, {what} {name!r}"
        documented = python_default(rows[name][0], where)
        assert same(documented, parameter.default), f"{where}: documented {documented!r}, the code has {parameter.default!r}"


# ------------------------------------------------------------------ titan_muon.Muon and build_param_groups


def test_every_constructor_argument_of_muon_is_documented_with_its_default(tables):
    check_signature(tables["muon"], Muon.__init__, "titan_muon.Muon arguments")
    positional = [name for name, p in inspect.signature(Muon.__init__).parameters.items()
                  if p.kind is p.POSITIONAL_OR_KEYWORD and name != "self"]  # fmt: skip
    documented = [name for name in tables["muon"] if name in positional]
    assert documented == positional, "docs/reference.md lists Muon's positional arguments in their order"
    summary = re.search(r"`Muon\(([^`]*?),\s*\*,", REFERENCE.read_text())
    assert summary is not None and [s.strip() for s in summary[1].split(",")] == positional


def test_every_keyword_of_build_param_groups_is_documented_with_its_default(tables):
    check_signature(tables["build_param_groups"], build_param_groups, "titan_muon.build_param_groups keywords")


# Values other than the defaults for the constructor arguments that param groups inherit, to see
# which argument fills which group key.
OTHER_VALUES = dict(lr=0.0123, weight_decay=0.0456, momentum=0.9, nesterov=False, ns_steps=3, adjust_lr_fn="match_rms_adamw",
                    ns_coefficients="polar_express", ns_algorithm="gram", ns_eps=2e-7, adamw_betas=(0.8, 0.9), adamw_eps=3e-8)  # fmt: skip
TORCH_GROUP_KEYS = ("params", "param_names")  # torch.optim's own, not in `defaults`


def tiny_muon(**kwargs) -> Muon:
    """One Muon group (a 2-D weight) and one AdamW group (its bias), in one process."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 16)
    groups = [{"params": [layer.weight], "param_names": ["weight"]}, {"params": [layer.bias], "param_names": ["bias"], "use_muon": False}]
    return Muon(groups, **kwargs)


def inherited_from(cell: str) -> dict[str, str]:
    """{"Muon" / "AdamW": constructor argument} of a default cell such as "`ns_eps` (Muon),
    `adamw_eps` (AdamW)"; an argument named without a group fills both."""
    found: dict[str, str] = {}
    for name, group in re.findall(r"`(\w+)`(?: \((Muon|AdamW)\))?", cell):
        for kind in (group,) if group else ("Muon", "AdamW"):
            assert kind not in found, f"default cell {cell!r} names two arguments for {kind} groups"
            found[kind] = name
    return found


def literal_in(cell: str):
    """The Python literal a cell holds as its one code span, or None (a name, or text)."""
    span = re.fullmatch(r"`([^`]+)`", cell)
    if span is None:
        return None
    try:
        return (ast.literal_eval(span[1]),)
    except (ValueError, SyntaxError):
        return None


def test_every_param_group_key_is_documented_with_where_its_default_comes_from(tables):
    rows = tables["group"]
    optimizer = tiny_muon()
    check_same_keys(rows, [*TORCH_GROUP_KEYS, *optimizer.defaults], "param-group keys")
    signature = inspect.signature(Muon.__init__).parameters
    changed = tiny_muon(**OTHER_VALUES)
    kinds = {"Muon": changed.param_groups[0], "AdamW": changed.param_groups[1]}
    for key, (cell, _) in rows.items():
        where = f"docs/reference.md, param-group key {key!r}"
        if key in TORCH_GROUP_KEYS:
            assert cell in (REQUIRED, UNSET), f"{where}: {cell!r}"
            continue
        literal = literal_in(cell)
        if literal is None:
            sources = inherited_from(cell)
            assert sources, f"{where}: the default is a literal or the constructor argument(s) it comes from, got {cell!r}"
            for kind, argument in sources.items():
                assert argument in signature, f"{where}: {argument!r} is not an argument of titan_muon.Muon"
                assert argument in OTHER_VALUES, f"tests/test_reference.py: add a non-default value of {argument!r} to OTHER_VALUES"
                assert not same(OTHER_VALUES[argument], signature[argument].default), argument
                assert same(OTHER_VALUES[argument], kinds[kind][key]), f"{where}: a {kind} group's {key!r} does not come from {argument!r}"
        else:
            assert same(literal[0], optimizer.defaults[key]), f"{where}: documented {literal[0]!r}, the code has {optimizer.defaults[key]!r}"


def test_every_documented_attribute_exists_with_its_initial_value(tables):
    optimizer = tiny_muon()
    for name, (cell, _) in tables["attributes"].items():
        where = f"docs/reference.md, attribute {name!r}"
        assert hasattr(optimizer, name), f"{where}: titan_muon.Muon has no such attribute"
        if cell == "method":
            assert callable(getattr(optimizer, name)), where
        else:
            documented = python_default(cell, where)
            assert same(documented, getattr(optimizer, name)), f"{where}: documented {documented!r}, the code has {getattr(optimizer, name)!r}"


def test_the_metrics_of_a_step_are_the_documented_ones(tables):
    rows = tables["metrics"]
    every_step = {key for key, (when, _) in rows.items() if when == "every step"}
    with_rms = every_step | {key for key, (when, _) in rows.items() if when == "`measure_update_rms`"}
    for when, _ in rows.values():
        assert when in ("every step", "`measure_update_rms`", "`overlap`", "`demo`"), f"docs/reference.md, metrics: when {when!r}?"
    optimizer = tiny_muon()
    for measure, expected in ((True, with_rms), (False, every_step)):
        optimizer.measure_update_rms = measure
        optimizer.zero_grad()
        layer_weight, layer_bias = (group["params"][0] for group in optimizer.param_groups)
        (torch.ones(8) @ layer_weight.T + layer_bias).square().sum().backward()
        optimizer.step()
        observed = set(optimizer.last_step_metrics)
        assert observed == expected, f"measure_update_rms={measure}: undocumented {sorted(observed - expected)}, not produced {sorted(expected - observed)}"


# ------------------------------------------------------------------ the [optimizer] section


def config_module():
    """The module the reference tells torchtitan to load for titan_muon's [optimizer] keys."""
    named = re.search(r'custom_config_module = "([\w.]+)"', REFERENCE.read_text())
    assert named is not None, "docs/reference.md names the custom_config_module"
    return importlib.import_module(named[1])


def test_every_toml_key_of_titan_muon_is_documented_with_its_default(tables):
    section = config_module().JobConfig().optimizer  # what torchtitan merges into its [optimizer]
    defaults = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    rows = tables["toml"]
    check_same_keys(rows, defaults, "titan_muon's [optimizer] keys")
    for key, default in defaults.items():
        where = f"docs/reference.md, [optimizer] {key}"
        documented = toml_default(rows[key][0], where)
        assert same(documented, default), f"{where}: documented {documented!r}, the code has {default!r}"


def test_torchtitans_own_optimizer_keys_are_documented_with_its_defaults(tables):
    version = importlib.metadata.version("torchtitan")
    if not version.startswith("0.2."):
        pytest.skip(f"the table has torchtitan 0.2.2's defaults (installed: {version})")
    from torchtitan.config.job_config import Optimizer

    ours = {f.name for f in dataclasses.fields(config_module().JobConfig().optimizer)}
    theirs = {f.name: f.default for f in dataclasses.fields(Optimizer)}
    rows = tables["torchtitan-toml"]
    assert not set(rows) & ours, "a key is in both [optimizer] tables"
    check_same_keys(rows, theirs, "torchtitan's [optimizer] keys")
    for key, default in theirs.items():
        where = f"docs/reference.md, torchtitan's [optimizer] {key}"
        documented = toml_default(rows[key][0], where)
        assert same(documented, default), f"{where}: documented {documented!r}, torchtitan has {default!r}"


# ------------------------------------------------------------------ the README


def markdown_tables_cells(text: str) -> list[str]:
    return [cell for line in text.splitlines() if line.startswith("|") and not re.fullmatch(r"\|[\s:|-]+", line) for cell in split_row(line)]


HISTORY = re.compile(r"\b(20\d\d-\d\d-\d\d|issues? \d+|waves? \d+|since issue|before wave)\b", re.IGNORECASE)


@pytest.mark.parametrize("path", [README, REFERENCE], ids=["README", "reference"])
def test_no_dates_nor_issue_numbers(path):
    found = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, f"{path.name} carries history (docs/history.md holds it): {found}"


def test_the_readme_stays_short():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    long = [cell for cell in markdown_tables_cells(text) if len(cell.split()) > 30]
    assert not long, f"README table cells over 30 words: {long}"


def test_the_readme_opens_with_the_commands_ci_runs():
    readme, ci = README.read_text(), (REPO / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)[:2]
    assert len(commands) == 2 and "scripts/train.sh" in commands[0] and "pytest" in commands[1]
    assert commands[1] in ci.splitlines(), ".ci/run runs the README's test command verbatim"


def test_the_readmes_toml_uses_documented_keys_only(tables):
    blocks = re.findall(r"```toml\n(.*?)\n```", README.read_text(), re.DOTALL)
    assert blocks, "the README shows an [optimizer] section"
    section = tomllib.loads(blocks[0])["optimizer"]
    documented = set(tables["toml"]) | set(tables["torchtitan-toml"])
    assert set(section) <= documented, sorted(set(section) - documented)
    assert section["name"] == "Muon"


# ------------------------------------------------------------------ links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (heading := re.match(r"#{1,6} (.*)", line)):
            base = slug(heading[1])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_local_links_of_the_readme_and_docs_resolve():
    broken = []
    for path in [README, *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_docs_index_lists_every_page():
    index = (REPO / "docs" / "index.md").read_text()
    listed = set(re.findall(r"^- \[([\w.]+\.md)\]\(\1\)", index, re.MULTILINE))
    pages = {path.name for path in (REPO / "docs").glob("*.md")} - {"index.md"}
    assert listed == pages, f"docs/index.md: not listed {sorted(pages - listed)}, listed but absent {sorted(listed - pages)}"
