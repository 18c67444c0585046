"""What a non-editable install (the KubeRay image's `pip install .`) must carry."""
import fnmatch
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
