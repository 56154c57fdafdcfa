"""The simulator's compiled parts, optional (setup.py builds them where a C compiler is
found): the replay kernel (``_kernel.c``, with ``_kernel_gittins.h``), the offline
optimum (``_optimum.c``) and the curves' stack distances (``_curves.c``), sharing one
hash map (``_simmap.h``). Each has a Python reference that tests/sim/ holds it to:
``engines.CacheStepper`` (the real ``PrefixCache``; ``minitree.MiniTree`` for the
miniatures' head cost), ``optimum.belady`` and ``curves``' full replays.
"""
