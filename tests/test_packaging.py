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


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_lists_every_doc_and_its_links_resolve():
    """The README's layout lists every page under docs/, and every relative link in the README
    and the docs points at a file that exists (a moved section must take its links along)."""
    readme = (ROOT / "README.md").read_text()
    unlisted = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not unlisted, f"README.md's layout does not list: {unlisted}"
    broken = []
    for page in _doc_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing files: {broken}"


def test_readme_says_to_activate_the_venv():
    """Commands outside make (`serve run`, `python -m serve_app.batch`, `python -m loadtest`) run
    in .venv/; a new user who is not told so gets `command not found` or `No module named`."""
    assert "source .venv/bin/activate" in (ROOT / "README.md").read_text()


def test_documented_make_targets_and_serve_targets_exist():
    """`make X` named in the docs is a Makefile target; `serve run` names a config file that
    exists or a `module:function` that the module defines."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for page in _doc_pages():
        text = page.read_text()
        for target in re.findall(r"`make ([a-z][\w-]*)", text):
            assert target in targets, f"{page.name}: `make {target}` is not a Makefile target"
        for arg in re.findall(r"serve run ([\w./:-]+)", text):
            if arg.endswith((".yaml", ".yml")):
                if arg.startswith("deploy/"):
                    assert (ROOT / arg).is_file(), f"{page.name}: serve run {arg}: no such file"
                continue
            module, _, attr = arg.partition(":")
            if not attr:
                continue
            source = ROOT.joinpath(*module.split(".")).with_suffix(".py")
            assert source.is_file(), f"{page.name}: serve run {arg}: no module {module}"
            assert re.search(rf"^(def {attr}\b|{attr}\s*=)", source.read_text(), re.M), (
                f"{page.name}: serve run {arg}: {module} defines no {attr}")
