"""Quality gates beyond the blend mode's: what a lossy way of storing the KV costs in
answers, per model, measured with the blend gate's machinery (``blend/gate.py``,
``blend/verdict.py``) and checked when a server starts.

    codecs.py      the measurement: a cached prefix through each codec's frames
    codec_cli.py   ``prefixcache gate-codec``: measure, judge, store
    codec_gate.py  the store's keys and the start check (reads a file: no model runs)

The modules are imported by name; this package's import loads none of them, so the
start check does not pull in the measurement.
"""
