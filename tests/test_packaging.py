"""What a non-editable install (the KubeRay image's `pip install .`) must carry."""
import fnmatch
import os
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


def _documented_rayllm_commands() -> list[tuple[str, str, list[str]]]:
    """(where, verb, flags) for every `rayllm VERB ...` in the README, docs, Makefile and deploy/."""
    sources = [ROOT / "Makefile", ROOT / "deploy" / "Dockerfile", *_doc_pages()]
    found = []
    for path in sources:
        # In code: `rayllm serve ...`, a line of a code block, $(BIN)/rayllm, CMD ["rayllm", "serve"].
        for verb, rest in re.findall(r"(?:^|[`/\"])rayllm[\",\s]+([a-z]+)\b([^`\n]*)", path.read_text(), re.M):
            found.append((path.name, verb, re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)))
    return found


def test_documented_rayllm_commands_exist():
    """Every `rayllm VERB` the docs, the Makefile and the Dockerfile give is a verb of the command,
    and every flag given to it (serve, chat, complete, models) is one of that verb's flags."""
    from serve_app.cli.main import build_parser

    verbs = build_parser()._subparsers._group_actions[0].choices
    commands = _documented_rayllm_commands()
    assert {"serve", "chat", "complete", "bench", "batch", "models"} <= {verb for _, verb, _ in commands}, \
        "docs/serving.md documents every verb"
    for where, verb, flags in commands:
        assert verb in verbs, f"{where}: rayllm {verb}: no such command"
        if verb in ("bench", "batch"):  # their own CLIs (loadtest, serve_app.batch) parse the rest
            continue
        options = set(verbs[verb]._option_string_actions)
        unknown = [f for f in flags if f not in options]
        assert not unknown, f"{where}: rayllm {verb}: no such flags {unknown}"


def test_wheel_installs_the_rayllm_command(tmp_path):
    """`pip install .` without the Makefile: the built wheel carries the console script and the C
    kernel sources, and `rayllm --help` / `rayllm serve --help` / `python -m engine` run from it.
    The venv sees .venv's dependencies (a .pth line, not .venv's editable install of this checkout)."""
    import shutil
    import subprocess
    import sys
    import sysconfig
    import zipfile

    # No PYTHONPATH in any step (a Ray cluster started earlier in this session sets it to the checkout):
    # pip would see the checkout's egg-info as rayllm-serve installed already and skip the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("engine", "kernels", "serve_app", "loadtest"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, timeout=300, capture_output=True, env=env)
    wheel = next(dist.glob("rayllm_serve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("serve_app/cli/") for n in names) and any(n.startswith("kernels/") and n.endswith(".c")
                                                                      for n in names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120, env=env)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, env=env).stdout.strip()
    Path(purelib, "deps-from-dot-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300, capture_output=True, env=env)

    def run(*argv) -> str:
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert run(python, "-c", "import serve_app; print(serve_app.__file__)").startswith(purelib)
    assert "serve" in run(venv / "bin" / "rayllm", "--help")
    assert "--max-num-seqs" in run(venv / "bin" / "rayllm", "serve", "--help")
    assert "LlamaForCausalLM" in run(python, "-m", "engine")
