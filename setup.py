"""The one compiled part: the trace simulator's replay kernel (src/prefixcache/sim/_kernel.c).

NOTE: optional. Where no C compiler is found the package installs without it and
``prefixcache replay`` runs every configuration on the reference engine (the real
``PrefixCache``), only slower; the results say which engine ran.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "prefixcache.sim._kernel",
            ["src/prefixcache/sim/_kernel.c"],
            extra_compile_args=[
                "-O2",
                "-std=c11",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
            ],
            optional=True,
        )
    ]
)
