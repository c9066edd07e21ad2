"""The compiled parts of the package: appliance/store/_md5lanes.c (MD5 of up to 8 streams at once, AVX2) and
appliance/store/_tlsread.c (an https body many TLS records at a time, the GIL released once). Optional: where they
do not build (no compiler), the package installs without them, appliance/store/md5lanes.py hashes with hashlib and
appliance/store/httpget.py reads through the ssl module. Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("appliance.store._md5lanes", ["appliance/store/_md5lanes.c"], optional=True,
                             extra_compile_args=["-O3"]),
                   # no OpenSSL headers or link: it calls the OpenSSL that Python's _ssl module loaded (dlsym)
                   Extension("appliance.store._tlsread", ["appliance/store/_tlsread.c"], optional=True,
                             extra_compile_args=["-O2"], libraries=["dl"])])
