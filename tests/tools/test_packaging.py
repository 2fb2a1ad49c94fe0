"""The wheel: an installed, non-editable ``ppstate`` finds its state tables (``specs/*.yaml``
shipped as package data, ``ppstate/specs/``) and runs the simulator outside the checkout.

One test (about 10-20 s on 2 cores): the sources are copied to a temp directory (so the build's
``build/`` and ``*.egg-info`` stay out of the checkout), the wheel is built offline with the
running interpreter's setuptools (``pip wheel --no-deps --no-build-isolation --no-index``) and
installed with ``--no-deps`` into a temp venv made by the running interpreter with
``--system-site-packages``. That venv sees the dependencies (numpy, pydantic, transitions, yaml)
through a ``.pth`` line naming the running environment's site-packages: a plain directory entry,
appended after the venv's own site-packages and without running that directory's ``.pth`` files,
so an editable install of ``ppstate`` there stays inactive and the wheel's copy is the one imported.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "ppstate", "runtime", "specs")

PROBE = """
import json, ppstate, ppstate.state_tables as spec
print(json.dumps({"ppstate": ppstate.__file__, "specs": str(spec.SPECS_DIR),
                  "tables": sorted(p.name for p in spec.SPECS_DIR.glob("*.yaml")),
                  "machines": {n: [spec.load_table(n).initial, len(spec.load_table(n).edges())]
                               for n in ("request", "slot", "pp_handler", "block")}}))
"""


def _run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)})
    assert proc.returncode == 0, f"{cmd}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_installed_wheel_ships_the_specs_and_runs_the_simulator(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(dist), str(src)], tmp_path)
    (wheel,) = dist.glob("ppstate-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
         tmp_path)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
          "-q", str(wheel)], tmp_path)
    venv_site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          tmp_path).strip())
    here = {sysconfig.get_path("purelib"), *site.getsitepackages()}
    (venv_site / "zz_test_deps.pth").write_text("\n".join(sorted(here)) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = json.loads(_run([str(py), "-c", PROBE], elsewhere))
    assert Path(probe["ppstate"]).is_relative_to(venv_site)   # the wheel's copy, not the checkout
    assert Path(probe["specs"]) == venv_site / "ppstate" / "specs"
    assert probe["tables"] == sorted(p.name for p in (ROOT / "specs").glob("*.yaml"))
    from ppstate.state_tables import load_table
    assert probe["machines"] == {n: [load_table(n).initial, len(load_table(n).edges())]
                                 for n in ("request", "slot", "pp_handler", "block")}

    out = json.loads(_run([str(py), "-m", "ppstate.sim", "--pp", "2", "--requests", "4",
                           "--seed", "1", "--json"], elsewhere))
    assert (out["completed"], out["aborted"], out["invariant_violations"]) == (4, 0, [])
    from ppstate.sim import SimConfig, run_sim
    assert out["output_tokens"] == run_sim(SimConfig(pp_size=2, num_requests=4, seed=1)).output_tokens
    assert not (ROOT / "ppstate" / "specs").exists()   # the checkout reads specs/ itself
