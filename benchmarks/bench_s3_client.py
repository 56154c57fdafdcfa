"""Which S3 client the object-store tier uses: boto3 or obstore, by measured GET throughput.

What a load from the tier does is many GETs of whole objects of one block frame each
(SmolLM2-135M in float32, 16-token blocks: about 737 KB), in parallel, a bounded number
at a time. This script puts 128 such objects (one 2,048-token prefix) into a real S3 API
server (moto in server mode, started here on loopback, as the tests do) and reads them
all back, again and again, with each client at the same concurrency:

- boto3: one thread-safe client (``max_pool_connections`` = concurrency, no retries),
  ``get_object(...)["Body"].read()`` on a pool of threads;
- obstore: one ``S3Store`` (Rust, object_store), ``obstore.get(...).bytes()`` on the
  same pool of threads, and ``get_async`` gathered under a semaphore on one event loop.

Order alternates and each is repeated; the median and spread are printed, with the
ratio to boto3. On loopback the server (moto, Python) is part of what is measured, and
both clients share the machine's cores with it: a client that spends less CPU per
request leaves more to the server. A real region is bound by the network instead.

Run:  .venv/bin/python benchmarks/bench_s3_client.py [--concurrency 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import boto3
import obstore
from botocore.config import Config
from obstore.store import S3Store as ObjectStore

from s3_server import ENV, MotoServer

OBJECTS = 128
OBJECT_BYTES = 737_280 + 160  # a float32 SmolLM2 block's payload and a header
BUCKET = "bench-client"


def boto3_reader(endpoint: str, concurrency: int) -> tuple[Callable[[list[str]], int], Callable[[], None]]:
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=Config(max_pool_connections=concurrency, retries={"total_max_attempts": 1}),
    )
    pool = ThreadPoolExecutor(concurrency)

    def one(key: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    return (lambda keys: sum(pool.map(one, keys))), pool.shutdown


def obstore_threads(endpoint: str, concurrency: int) -> tuple[Callable[[list[str]], int], Callable[[], None]]:
    store = ObjectStore(BUCKET, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True})
    pool = ThreadPoolExecutor(concurrency)

    def one(key: str) -> int:
        return len(obstore.get(store, key).bytes())

    return (lambda keys: sum(pool.map(one, keys))), pool.shutdown


def obstore_async(endpoint: str, concurrency: int) -> tuple[Callable[[list[str]], int], Callable[[], None]]:
    store = ObjectStore(BUCKET, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True})
    loop = asyncio.new_event_loop()

    async def all_of(keys: list[str]) -> int:
        gate = asyncio.Semaphore(concurrency)

        async def one(key: str) -> int:
            async with gate:
                got = await obstore.get_async(store, key)
                return len(await got.bytes_async())

        return sum(await asyncio.gather(*(one(k) for k in keys)))

    return (lambda keys: loop.run_until_complete(all_of(keys))), loop.close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ.update(ENV)
    with tempfile.TemporaryDirectory() as tmp:
        server = MotoServer(Path(tmp)).start()
        try:
            run(server.endpoint, args.concurrency, args.repeats)
        finally:
            server.stop()


def run(endpoint: str, concurrency: int, repeats: int) -> None:
    setup = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    setup.create_bucket(Bucket=BUCKET)
    body = os.urandom(OBJECT_BYTES)
    keys = [f"ns/{i:032x}" for i in range(OBJECTS)]
    for key in keys:
        setup.put_object(Bucket=BUCKET, Key=key, Body=body)
    readers = {
        "boto3 (threads)": boto3_reader(endpoint, concurrency),
        "obstore (threads)": obstore_threads(endpoint, concurrency),
        "obstore (asyncio)": obstore_async(endpoint, concurrency),
    }
    for read, _ in readers.values():  # warm: connections open, code paths hot
        assert read(keys) == OBJECTS * OBJECT_BYTES
    rates: dict[str, list[float]] = {name: [] for name in readers}
    cpu: dict[str, list[float]] = {name: [] for name in readers}  # this process's CPU (the client), not moto's
    names = list(readers)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            start, cpu_start = time.perf_counter(), time.process_time()
            readers[name][0](keys)
            rates[name].append(OBJECTS * OBJECT_BYTES / (time.perf_counter() - start) / 1e6)
            cpu[name].append((time.process_time() - cpu_start) / OBJECTS * 1e3)
    for _, close in readers.values():
        close()
    base = statistics.median(rates["boto3 (threads)"])
    print(f"{OBJECTS} GETs of {OBJECT_BYTES:,} bytes, {concurrency} at a time, moto on loopback, {repeats} runs each")
    for name, got in rates.items():
        mid = statistics.median(got)
        print(
            f"  {name:<18} {mid:7.1f} MB/s  (min {min(got):6.1f}, max {max(got):6.1f})  "
            f"{mid / base:5.2f}x boto3  {mid * 1e6 / OBJECT_BYTES:5.0f} GETs/s  "
            f"client CPU {statistics.median(cpu[name]):.2f} ms/GET"
        )


if __name__ == "__main__":
    main()
