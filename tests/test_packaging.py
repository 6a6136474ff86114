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
