"""How long `plan` spends fingerprinting a 10k-object s3:// input prefix.

The fingerprint is one paginated listing (sizes + ETags); the baseline is what hashing the
content would cost: reading every object. Both against moto's S3 server on 127.0.0.1, in the
same run (a real S3 endpoint adds ~20-50 ms per request, which favours the listing more).

    python benchmarks/fingerprint_listing.py [--objects 10000] [--object-bytes 4096]
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=10_000)
    ap.add_argument("--object-bytes", type=int, default=4096)
    args = ap.parse_args()

    import boto3
    import fsspec
    from moto.server import ThreadedMotoServer

    from pipeline.fingerprints import fingerprint
    from stages.common.ports import reserved_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request
    with reserved_port() as port:  # until the server listens on it
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bench", "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"}}
    boto3.client("s3", endpoint_url=opts["endpoint_url"], aws_access_key_id="bench",
                 aws_secret_access_key="bench", region_name="us-east-1").create_bucket(Bucket="bench")
    fs = fsspec.filesystem("s3", **opts)
    body = b"x" * args.object_bytes
    t = time.perf_counter()
    fs.pipe({f"bench/corpus/part-{i:06d}.jsonl": body for i in range(args.objects)})
    print(f"uploaded {args.objects} objects of {args.object_bytes} B in {time.perf_counter() - t:.1f} s")

    calls: list[str] = []
    fs.connect()
    fs.s3.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
    t = time.perf_counter()
    fp = fingerprint("s3://bench/corpus/", opts, 0)
    listing_s = time.perf_counter() - t
    print(f"fingerprint (listing): {listing_s:.2f} s, {len(calls)} requests "
          f"({', '.join(sorted(set(calls)))}): {fp.summary}")

    calls.clear()
    t = time.perf_counter()
    h = hashlib.sha256()
    for path, data in sorted(fs.cat(fs.find("bench/corpus/")).items()):
        h.update(path.encode())
        h.update(data)
    reading_s = time.perf_counter() - t
    print(f"baseline (read every object): {reading_s:.2f} s, {len(calls)} requests")
    print(f"listing is {reading_s / listing_s:.1f}x faster")
    server.stop()


if __name__ == "__main__":
    main()
