"""Quality gates that measure a model's own noise floor: a way of serving the KV other
than computing it in full (a lossy codec; blend's reuse beyond the prefix) is allowed
for a model only once its answers stay within that floor, measured on the model's
weights (keyed by their content: ``prefixcache.weights``) and checked when a server starts.

    evalset.py     the evaluation set: prompts whose reusable parts were cached alone
    reference.py   the set prepared on a model: references, the noise floor, scoring
    verdict.py     figures, bars, ``judge``, ``GateStore`` (the gates' JSON file)
    codecs.py      the codec gate's measurement: a cached prefix through each codec's frames
    codec_cli.py   ``prefixcache gate-codec``: measure, judge, store
    codec_gate.py  the codec gate's keys and the start check (reads a file: no model runs)

The blend gate (``blend/gate.py``) measures its plans with this machinery; nothing here
imports ``blend/``. The modules are imported by name; this package's import loads none
of them, so the start check does not pull in the measurement.
"""
