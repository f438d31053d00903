"""producer: writes KV chunks into the shared pool through a running cxlkv
server, under LMCache-style object keys, then exits. The chunks stay
readable by every process.

    usage: python producer.py SOCKET [COUNT]

Half of the chunks are written in place (a lease's page, filled through a
writable memoryview), the rest copied in by ``batch_put``.
"""

import sys

import cxlkv

PAGE_SIZE_BYTES = 64 << 10
FINGERPRINT = 0x7079746F6E  # "python": the model's layout


def key(i: int) -> str:
    return cxlkv.object_key("example-model", kv_rank=0, chunk_hash=i.to_bytes(4, "big"))


def chunk(i: int) -> bytes:
    n = 4096 * (i % 4 + 1) + i
    return bytes((i * 31 + j * 7) % 256 for j in range(n))


def main() -> int:
    socket_path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    in_place = count // 2
    with cxlkv.Client.connect(socket_path, region_size_bytes=4 << 20) as client:
        layout = client.layout(PAGE_SIZE_BYTES, FINGERPRINT)

        leases = layout.batch_alloc(in_place)
        for i, lease in enumerate(leases):
            data = chunk(i)
            page = lease.memoryview()  # the page itself, in the pool
            page[: len(data)] = data
            del page  # no memoryview may outlive the registration
            lease.set_len(len(data))
        results = layout.batch_register((key(i), lease) for i, lease in enumerate(leases))

        results += layout.batch_put((key(i), chunk(i)) for i in range(in_place, count))

        if any(r.outcome == "rejected" for r in results):
            print("producer: a chunk was rejected", file=sys.stderr)
            return 1
        inserted = sum(r.inserted for r in results)
        print(f"producer (Python): {count} chunks: {inserted} inserted, {count - inserted} already there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
