"""The package as pip installs it: every sub-package ships."""

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
