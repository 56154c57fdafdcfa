"""Trace simulator: replays request traces through the real cache and reports what they would save."""
