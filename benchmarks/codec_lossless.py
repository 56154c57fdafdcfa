"""Does a lossless byte compressor on top of a codec's frames pay? (issue #29: zstd or lz4
for disk and Redis "if the benchmark shows it pays").

Real KV: SmolLM2-135M's prefill of this repository's README (float32, 16-token blocks),
framed by each codec, then each frame compressed by zstd (levels 1 and 3) and lz4. It
prints the extra ratio each compressor gives over the frame, and zstd's and lz4's
compression speed on one core, beside the cost of the frame itself.

    pip install zstandard lz4            # not dependencies of prefixcache
    python benchmarks/codec_lossless.py [--tokens 1024]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from prefixcache.engine.model import load_model
from prefixcache.storage import codec

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16


def real_kv(tokens: int) -> np.ndarray:
    """[layers, 2, kv_heads, tokens, head_dim] of the model's prefill of the README."""
    lm = load_model(models_dir=ROOT / ".prefixcache" / "models", device="cpu")
    ids = lm.tokenizer((ROOT / "README.md").read_text(), return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        cache = lm.model(ids, use_cache=True).past_key_values
    layers = [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
    return torch.stack(layers).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    try:
        import lz4.frame
        import zstandard
    except ImportError:
        raise SystemExit("needs zstandard and lz4: pip install zstandard lz4") from None
    torch.set_num_threads(1)
    kv = real_kv(args.tokens)
    blocks = [np.ascontiguousarray(kv[:, :, :, b : b + BLOCK]) for b in range(0, kv.shape[3] - BLOCK + 1, BLOCK)]
    compressors = {
        "zstd-1": zstandard.ZstdCompressor(level=1).compress,
        "zstd-3": zstandard.ZstdCompressor(level=3).compress,
        "lz4": lz4.frame.compress,
    }
    print(f"{len(blocks)} blocks of SmolLM2 KV {kv.dtype}; extra ratio over the frame, compression speed (1 core)")
    print(f"{'codec':6} {'frame bytes':>12}  " + "  ".join(f"{n:>18}" for n in compressors))
    for name in codec.CODECS:
        frames = [codec.encode(b"k" * 32, b"", blk, codec=name) for blk in blocks]
        size = sum(len(f) for f in frames)
        cells = []
        for compress in compressors.values():
            started = time.perf_counter()
            packed = sum(len(compress(f)) for f in frames)
            seconds = time.perf_counter() - started
            cells.append(f"{size / packed:6.3f}x {size / seconds / 1e9:6.2f} GB/s")
        print(f"{name:6} {size:>12,}  " + "  ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
