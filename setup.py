"""Build step that ships the state tables: ``specs/*.yaml`` is copied into the package as
``ppstate/specs/`` (package data), where an installed, non-editable ``ppstate`` finds it through
``importlib.resources`` (:data:`ppstate.state_tables.SPECS_DIR`). Everything else is in pyproject.toml.

The tables stay in ``specs/`` at the top of the repository (they are data, read by the core, the
diagrams and the docs); a source checkout or an editable install reads them there.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithSpecs(build_py):
    """``build_py`` that also copies ``specs/*.yaml`` to ``<build_lib>/ppstate/specs/``."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "ppstate" / "specs"
        self.mkpath(str(target))
        for table in sorted((ROOT / "specs").glob("*.yaml")):
            self.copy_file(str(table), str(target / table.name))


setup(cmdclass={"build_py": BuildPyWithSpecs})
