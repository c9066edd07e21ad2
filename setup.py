"""The compiled parts of the package: appliance/store/_md5lanes.c (MD5 of up to 8 streams at once, AVX2),
appliance/store/_tlsread.c (an https body many TLS records at a time, the GIL released once) and
appliance/store/_heldio.c (the stager's small file calls with the GIL held). Optional: where they do not build (no
compiler), the package installs without them, appliance/store/md5lanes.py hashes with hashlib,
appliance/store/httpget.py reads through the ssl module and appliance/store/heldio.py calls the os module.
Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("appliance.store._md5lanes", ["appliance/store/_md5lanes.c"], optional=True,
                             extra_compile_args=["-O3"]),
                   # no OpenSSL headers or link: it calls the OpenSSL that Python's _ssl module loaded (dlsym)
                   Extension("appliance.store._tlsread", ["appliance/store/_tlsread.c"], optional=True,
                             extra_compile_args=["-O2"], libraries=["dl"]),
                   Extension("appliance.store._heldio", ["appliance/store/_heldio.c"], optional=True,
                             extra_compile_args=["-O2"])])
