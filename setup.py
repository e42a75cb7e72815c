"""Wheel tagging only (metadata lives in pyproject.toml).

The package carries a prebuilt, Python-version-independent torch extension (arfuse/_lib/
libarfuse_ops.so, built by `make`, loaded with torch.ops.load_library), so the wheel is tagged
py3-none-<platform>: platform specific, but not tied to one CPython ABI.
"""

import sysconfig

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        return "py3", "none", sysconfig.get_platform().replace("-", "_").replace(".", "_")


setup(distclass=BinaryDistribution, cmdclass={"bdist_wheel": PlatformWheel})
