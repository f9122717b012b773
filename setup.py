"""Everything about the package is in pyproject.toml; this only adds one build step: the
top-level ``topics/`` and ``configs/`` (the repository's fixed layout) are copied into the built
package as ``streamrl/_packaged/`` so an installed streamrl carries them (``streamrl.packaged``).
Editable installs read them in place and skip the copy."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithResources(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for kind in ("topics", "configs"):
            target = Path(self.build_lib) / "streamrl" / "_packaged" / kind
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(ROOT / kind, target)


setup(cmdclass={"build_py": BuildPyWithResources})
