"""docs/architecture.md stays true: every file it names exists, and the arrows it draws hold in the code
(read from each module's imports, not by importing it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
# Folders mapped to import packages (pyproject's package-dir).
ROOMS = {"moewatch": "moewatch", "agent": "moewatch.agent", "runtime": "moewatch.runtime", "tools": "moewatch.tools"}


def named_paths(text: str) -> list[str]:
    """Paths in backticks that name a file or folder of the repository (`agent/policy.py`, `tools/`)."""
    found = []
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.rstrip(".,")
        if "<" in token:  # a template such as `moewatch/integrations/<engine>/`
            continue
        if token.endswith("/") or token.endswith(".py") or token.endswith(".md"):
            found.append(token)
    return found


def test_the_architecture_doc_names_only_files_that_exist():
    paths = named_paths(DOC.read_text())
    assert len(paths) > 30, "the doc names the rooms and files it describes"
    missing = []
    for name in paths:
        candidates = [REPO / name, REPO / "moewatch" / name, REPO / "agent" / name, REPO / "runtime" / name]
        if "/" not in name.rstrip("/"):
            # A bare file name in a room's row: it must exist somewhere in the product packages.
            candidates += [p for room in ROOMS for p in (REPO / room).rglob(name)]
        if not any(c.exists() for c in candidates):
            missing.append(name)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_named_paths_finds_what_a_reader_sees():
    assert named_paths("see `agent/policy.py`, `tools/` and `moewatch_actions_total`.") == ["agent/policy.py",
                                                                                             "tools/"]


def imports_of(path: Path, package: str) -> set[str]:
    """Absolute module names a file imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if node.module is None:  # `from . import policy`: the names are modules
                out.update(f"{module}.{alias.name}" for alias in node.names)
            else:
                out.add(module)
    return out


def room_modules(folder: str) -> list[tuple[Path, str]]:
    """(file, its package) for every module of a room."""
    root = REPO / folder
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        package = ".".join([ROOMS[folder], *parts[:-1]])
        out.append((path, package))
    return out


FORBIDDEN = {
    # The core is imported by everyone and imports none of the others, nor torch.
    "moewatch": ("moewatch.agent", "moewatch.runtime", "moewatch.tools", "torch", "triton"),
    # The sidecar never imports torch, the runtime or the tools.
    "agent": ("moewatch.runtime", "moewatch.tools", "torch", "triton"),
    # The runtime never imports the agent or the tools.
    "runtime": ("moewatch.agent", "moewatch.tools"),
}
# The core's only lazy doors to the tools and to torch: the `examples` verb and SGLang's .pt reader.
ALLOWED = {("moewatch/commands.py", "moewatch.tools.examples"), ("moewatch/integrations/sglang/dump.py", "torch")}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_the_arrows_point_one_way(folder):
    wrong = []
    for path, package in room_modules(folder):
        rel = str(path.relative_to(REPO))
        for module in imports_of(path, package):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[folder]) \
                    and (rel, module) not in ALLOWED:
                wrong.append(f"{rel} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_imports_of_resolves_relative_imports(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("from . import policy\nfrom ..planner import solve\nimport torch\n")
    assert imports_of(mod, "moewatch.agent") == {"moewatch.agent.policy", "moewatch.planner", "torch"}


def test_every_package_folder_is_listed_for_the_install():
    # A subpackage pyproject does not list is missing from a wheel (`pip install .`, the Docker image)
    # while an editable install still finds it: the sidecar then fails at import in production only.
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, package in ROOMS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *parts)))
    assert found - listed == set(), f"packages missing from pyproject's [tool.setuptools] packages: {found - listed}"


ENGINE_NAMES = re.compile(r"sglang|vllm", re.IGNORECASE)


def engine_names_in_code(source: str) -> list[tuple[int, str]]:
    """(line, token) for each token of Python source that names an engine, comments and docstrings
    aside: identifiers, strings (messages, labels, help texts) and f-strings are code."""
    import io
    import tokenize

    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            docstrings.add((body[0].lineno, body[0].col_offset))
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE) or tok.start in docstrings:
            continue
        if ENGINE_NAMES.search(tok.string):
            found.append((tok.start[0], tok.string))
    return found


def test_the_agent_names_no_engine_in_its_code():
    # An engine's names, config and labels live in its room (moewatch/integrations/<engine>/, through
    # the registry): the agent, its policy and its daemon ask the registry and never name one.
    named = [f"{path.relative_to(REPO)}:{line}: {token}" for path, _ in room_modules("agent")
             for line, token in engine_names_in_code(path.read_text())]
    assert not named, "\n".join(named)


def test_engine_names_in_code_leaves_comments_and_docstrings_alone():
    source = ('"""About vLLM."""\n\n\ndef f():\n    """SGLang\'s."""\n    # sglang here is a comment\n'
              '    x = "vllm"\n    return sglang_dump_dir, f"{x} sglang"\n')
    assert engine_names_in_code(source) == [(7, '"vllm"'), (8, "sglang_dump_dir"), (8, 'f"{x} sglang"')]
