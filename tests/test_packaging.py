"""What a non-editable install (the KubeRay image's `pip install .`) must carry."""
import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_the_cpu_kernel_sources():
    """kernels/*.c are compiled at first use: without them an installed engine silently
    falls back to the slower torch path on CPU."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"].get("package-data", {}).get("kernels", [])
    sources = [p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".c", ".h")]
    assert sources, "kernels/ should hold the CPU C kernel sources"
    missing = [name for name in sources if not any(fnmatch.fnmatch(name, g) for g in globs)]
    assert not missing, f"not in [tool.setuptools.package-data] kernels: {missing}"


def _documented_modules() -> dict[str, str]:
    """`python -m NAME` of our packages named in the Makefile, README, docs and scripts -> where."""
    ours = ("engine", "kernels", "serve_app", "loadtest")
    sources = [ROOT / "Makefile", ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *ROOT.glob("*/*.sh")]
    found = {}
    for path in sources:
        for name in re.findall(r"-m ([A-Za-z_][\w.]*)", path.read_text()):
            if name.split(".")[0] in ours:
                found.setdefault(name, path.name)
    return found


def test_documented_commands_name_installed_modules():
    """Every `python -m ...` the docs and the Makefile give runs a module that exists and that
    `pip install .` ships (a moved tool must take its commands along)."""
    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = set(find_packages(str(ROOT), include=config["tool"]["setuptools"]["packages"]["find"]["include"]))
    modules = _documented_modules()
    assert "engine.tools.demo_model" in modules, "make serve's model fetch should be documented"
    for name, where in modules.items():
        path = ROOT.joinpath(*name.split("."))
        if path.is_dir():
            assert (path / "__main__.py").is_file(), f"{where}: package {name} has no __main__"
            package = name
        else:
            assert path.with_suffix(".py").is_file(), f"{where}: python -m {name}: no such module"
            package = name.rpartition(".")[0]
        assert package in shipped, f"{where}: {name} is outside the packages pip installs"
