"""consumer: reads the producer's chunks in place — each view's memoryview
is the pool's memory mapped into this process, nothing is copied — checks
them, releases them and deletes the keys.

    usage: python consumer.py SOCKET [COUNT]

Waits (up to 30 s) for the producer's keys, so either may start first.
"""

import sys
import time

import cxlkv

PAGE_SIZE_BYTES = 64 << 10
FINGERPRINT = 0x7079746F6E


def key(i: int) -> str:
    return cxlkv.object_key("example-model", kv_rank=0, chunk_hash=i.to_bytes(4, "big"))


def chunk(i: int) -> bytes:
    n = 4096 * (i % 4 + 1) + i
    return bytes((i * 31 + j * 7) % 256 for j in range(n))


def main() -> int:
    socket_path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    keys = [key(i) for i in range(count)]
    mapped = []
    with cxlkv.Client.connect(
        socket_path, on_map=lambda region, offset, base, length: mapped.append(region)
    ) as client:
        layout = client.layout(PAGE_SIZE_BYTES, FINGERPRINT)

        deadline = time.monotonic() + 30
        while not all(layout.batch_exists(keys)):
            if time.monotonic() > deadline:
                print("consumer: the producer's keys did not appear", file=sys.stderr)
                return 1
            time.sleep(0.01)

        good = 0
        with layout.batch_get(keys) as views:  # one round trip, all pinned
            for i, view in enumerate(views):
                data = view.memoryview()  # zero copy, read-only
                good += data == chunk(i)
                del data  # before the views are released
        # Released: nothing pins the keys any more.
        deleted = sum(r.outcome == "deleted" for r in layout.batch_delete(keys))
        print(
            f"consumer (Python): {good} of {count} chunks intact, "
            f"{len(mapped)} regions mapped, {deleted} deleted"
        )
        return 0 if good == count == deleted else 1


if __name__ == "__main__":
    sys.exit(main())
