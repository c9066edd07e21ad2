"""The one compiled part of the package: appliance/store/_md5lanes.c (MD5 of up to 8 streams at once, AVX2). Optional:
where it does not build (no compiler), the package installs without it and appliance/store/md5lanes.py hashes with
hashlib. Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("appliance.store._md5lanes", ["appliance/store/_md5lanes.c"], optional=True,
                             extra_compile_args=["-O3"])])
