"""The wheel carries what the README and docs/ use: every `configs/...yaml` they name ships inside the package,
and those names resolve from an installed copy run outside the repository."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_CONFIGS = sorted({c for doc in DOCS for c in re.findall(r"configs/(?:train|sweeps|research|smoothness)/\w+\.ya?ml", doc.read_text())})


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    src = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "configs", src / "configs")
    shutil.copytree(ROOT / "src", src / "src", symlinks=True,  # src/moga/configs is a link to ../../configs
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-w", str(out), str(src)], capture_output=True, text=True)
    if build.returncode != 0 and "No module named pip" in build.stderr:
        pytest.skip("pip is not installed in this environment")
    assert build.returncode == 0, build.stderr[-2000:]
    (found,) = out.glob("moga-*.whl")
    return found


def test_the_wheel_ships_every_config_the_readme_names(wheel):
    assert len(README_CONFIGS) >= 5
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [c for c in README_CONFIGS if f"moga/{c}" not in names]
    assert not missing
    assert all(f"moga/{c.relative_to(ROOT)}" in names for c in (ROOT / "configs").rglob("*.yaml"))


def test_readme_config_names_resolve_from_an_installed_copy(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"  # no configs/ here: the names must come from the package
    elsewhere.mkdir()
    script = (
        "import sys; from moga.train.config import load_config; from moga.sweep.spec import Sweep\n"
        "for name in sys.argv[1:]:\n"
        "    spec = Sweep.from_file(name) if '/sweeps/' in name or '/research/' in name else load_config(name)\n"
        "print(load_config('configs/train/shakespeare_char_gpt.yaml').model.name, Sweep.from_file("
        "'configs/sweeps/depth_transfer.yaml').source)\n"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", script, *[c for c in README_CONFIGS if "smoothness" not in c]],
                         cwd=elsewhere, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    model, source = run.stdout.split()
    assert model == "gpt" and Path(source).is_relative_to(site)
