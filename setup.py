"""What pyproject.toml cannot say: ship ``vllm_compat_auto.pth`` at the top of the wheel.

A ``.pth`` file must sit in site-packages itself for Python to run it at start-up (the coverage / pytest-cov
pattern). With ``VLLM_COMPAT_AUTO=1`` it imports vllm_compat; otherwise it only sets the forgotten-runner hint's
``sys.excepthook`` (vllm_compat/_bootstrap/hint.py, docs/how-it-works.md). Editable installs do not get it.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = os.path.join("vllm_compat", "_bootstrap", "vllm_compat_auto.pth")


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(PTH, os.path.join(self.build_lib, os.path.basename(PTH)), preserve_mode=False)


setup(cmdclass={"build_py": BuildPyWithPth})
