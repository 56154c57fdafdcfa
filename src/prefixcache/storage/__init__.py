"""Where a block's KV bytes live: the codec's frames, the stores that hold them
(device, memory, disk, Redis, and a metadata-only one for the simulator)."""
