"""Hypothesis profiles: CI replays a fixed set of examples (a red CI run is then a
regression, never bad luck); a developer's run explores new random examples."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
