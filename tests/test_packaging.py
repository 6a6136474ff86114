"""The package as pip installs it: every sub-package ships."""

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_sub_package_is_listed_for_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {"fxshard." + ".".join(init.parent.relative_to(ROOT / "fxshard").parts)
               for init in (ROOT / "fxshard").rglob("__init__.py")}
    on_disk = {name.rstrip(".") for name in on_disk} | {"fxshard.passes"}
    assert setuptools["package-dir"]["fxshard.passes"] == "passes"
    assert set(setuptools["packages"]) == on_disk


def test_every_name_the_docs_call_resolves_as_written():
    # A user copies `fxshard.checkpoint.save(...)` after `import fxshard`, plus the modules that page imports by name.
    # A fresh interpreter: the suite's own imports must not make a missing attribute look present.
    pages = {}
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        text = page.read_text()
        called = sorted(set(re.findall(r"\bfxshard((?:\.\w+)+)\(", text)))
        imported = sorted(set(re.findall(r"^(?:from|import) fxshard\.(\w+)", text, flags=re.M)))
        if called:
            pages[page.name] = (imported, called)
    script = f"""
import importlib, fxshard
after_plain_import = set(vars(fxshard))
unresolved = []
for page, (imported, called) in {pages!r}.items():
    for module in imported:
        importlib.import_module("fxshard." + module)
    for name in called:
        parts, obj = name.strip(".").split("."), fxshard
        if parts[0] not in after_plain_import and parts[0] not in imported:
            unresolved.append((page, "fxshard" + name))
        for part in parts:
            if not hasattr(obj, part):
                unresolved.append((page, "fxshard" + name))
                break
            obj = getattr(obj, part)
assert not unresolved, unresolved
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


# A private torch name: a module or attribute whose name starts with "_" reached from torch or torch.distributed.
_PRIVATE_TORCH = re.compile(r"\btorch(\.\w+)*\._\w|^\s*from torch[\w.]* import .*\b_\w|\bdist(\.\w+)*\._\w",
                            re.MULTILINE)


def test_only_torch_compat_reaches_into_private_torch():
    compat = ROOT / "fxshard" / "torch_compat.py"
    sources = [p for p in [*(ROOT / "fxshard").rglob("*.py"), *(ROOT / "passes").rglob("*.py")] if p != compat]
    code_of = {p: "\n".join(line for line in p.read_text().splitlines()
                            if not line.lstrip().startswith(("#", "``")) and "``" not in line) for p in sources}
    reaching = {str(p.relative_to(ROOT)): m.group(0) for p, code in code_of.items()
                if (m := _PRIVATE_TORCH.search(code))}
    assert reaching == {}, "import these through fxshard/torch_compat.py, which knows the torch versions"
    assert _PRIVATE_TORCH.search(compat.read_text())  # the pattern still finds what torch_compat imports


def _private_attributes(trees: dict) -> dict[str, list[str]]:
    """{attribute: [file:line]} of each ``x._name`` read or written in ``trees`` whose name fxshard does not define
    (as a function, class, module-level or local name): torch's private attributes (``module._parameters``,
    ``tensor._base``, ``op._schema``). ``self._x`` / ``cls._x`` are a class's own; ``os._exit`` is the stdlib's."""
    defined = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
    found: dict[str, list[str]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in defined
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os"))):
                found.setdefault(node.attr, []).append(f"{path}:{node.lineno}")
    return found


def test_only_torch_compat_reads_private_torch_attributes():
    compat = ROOT / "fxshard" / "torch_compat.py"
    trees = {str(p.relative_to(ROOT)): ast.parse(p.read_text())
             for p in [*(ROOT / "fxshard").rglob("*.py"), *(ROOT / "passes").rglob("*.py")] if p != compat}
    assert _private_attributes(trees) == {}, "read these through fxshard/torch_compat.py"
    # the check still finds what torch_compat reads
    assert {"_parameters", "_base", "_schema"} <= set(_private_attributes({"compat": ast.parse(compat.read_text())}))


# The packages from the bottom up (docs/architecture.md, "Layers"): each imports only its own modules and the layers
# below it, at module level or inside a function alike. A package missing here fails the test (KeyError).
LAYERS = [
    {"fxshard.torch_compat"},
    {"fxshard.errors"},
    {"fxshard.runtime"},
    {"fxshard.passes"},
    {"fxshard.budget"},
    {"fxshard.simulate"},
    {"fxshard.report"},
    {"fxshard.compiler", "fxshard.checkpoint", "fxshard.testing"},
    {"fxshard.api", "fxshard.predict"},
    {"fxshard"},
    {"fxshard.__main__"},
]


def _package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _fxshard_imports(path: pathlib.Path, module: str):
    """(imported fxshard module, line) for every import in the file, module-level or inside a function."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from fxshard import passes` names a package; `from .x import y` names module x
            targets = [f"{target}.{a.name}" for a in node.names] if target == "fxshard" else [target]
        else:
            continue
        yield from ((t, node.lineno) for t in targets if t == "fxshard" or t.startswith("fxshard."))


def test_no_package_imports_one_above_it():
    layer_of = {package: level for level, packages in enumerate(LAYERS) for package in packages}
    upward = []
    for root, prefix in ((ROOT / "fxshard", "fxshard"), (ROOT / "passes", "fxshard.passes")):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            module = ".".join((prefix, *parts)).removesuffix(".__init__")
            importer = _package_of(module) if module != "fxshard" else "fxshard"
            for target, line in _fxshard_imports(path, module):
                imported = _package_of(target) if target not in layer_of else target
                if imported != importer and layer_of[imported] >= layer_of[importer]:
                    upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert upward == [], "a package imports one at or above its own layer (LAYERS): " + "; ".join(upward)


def test_the_code_holds_no_dated_measurement():
    # measured figures live in docs/, with their date and machine; the code points there
    dated = re.compile(r"\b20\d\d-\d\d-\d\d\b")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in [*(ROOT / "fxshard").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]
             for n, line in enumerate(p.read_text().splitlines(), 1) if dated.search(line)]
    assert found == []
