"""The package as pip installs it: every sub-package ships."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_sub_package_is_listed_for_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {"fxshard." + ".".join(init.parent.relative_to(ROOT / "fxshard").parts)
               for init in (ROOT / "fxshard").rglob("__init__.py")}
    on_disk = {name.rstrip(".") for name in on_disk} | {"fxshard.passes"}
    assert setuptools["package-dir"]["fxshard.passes"] == "passes"
    assert set(setuptools["packages"]) == on_disk
