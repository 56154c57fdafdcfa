"""The compiled parts: the trace simulator's replay kernel (src/prefixcache/sim/native/_kernel.c)
and offline optimum (src/prefixcache/sim/native/_optimum.c), the stack distances of its
hit-rate curves (src/prefixcache/sim/native/_curves.c), and the disk tier's placed read
(src/prefixcache/storage/_placed.c).

NOTE: all optional. Where no C compiler is found the package installs without them:
``prefixcache replay`` runs every configuration on the reference engine (the real
``PrefixCache``), only slower, and the results say which engine ran; a disk load takes
the same steps in Python (storage/placed.py), one GIL-holding call each; the optimum is
computed by its Python reference (sim/optimum.py), slower and in memory.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "prefixcache.sim.native._kernel",
            ["src/prefixcache/sim/native/_kernel.c"],
            depends=["src/prefixcache/sim/native/_kernel_gittins.h", "src/prefixcache/sim/native/_simmap.h"],
            extra_compile_args=[
                "-O2",
                "-std=c11",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
            ],
            optional=True,
        ),
        Extension(
            "prefixcache.sim.native._optimum",
            ["src/prefixcache/sim/native/_optimum.c"],
            depends=["src/prefixcache/sim/native/_simmap.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "prefixcache.sim.native._curves",
            ["src/prefixcache/sim/native/_curves.c"],
            depends=["src/prefixcache/sim/native/_simmap.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "prefixcache.storage._placed",
            ["src/prefixcache/storage/_placed.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
    ]
)
