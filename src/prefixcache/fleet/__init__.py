"""Many servers, one cache: KV events, the global index a router keeps from them, and
the cost a router scores backends with (``docs/fleet.md``)."""
