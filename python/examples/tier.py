"""tier: the L1 tier as an engine's tiering controller drives it — store
(write, then write-through to L2 on ``write_finished``), promote from L2
into a private temporary, read with one hold per tensor-parallel worker,
evict through the listener's ``deleted``.

    usage: python tier.py SOCKET
"""

import sys

import cxlkv
from cxlkv import TierCode

PAGE_SIZE_BYTES = 64 << 10
FINGERPRINT = 0x746965720001
CHUNK_BYTES = 4096
TP_WORKERS = 2


class Controllers:
    """The engine's store controller and eviction policy, as a listener.
    Listeners run under the tier's lock: no calls back into the tier."""

    def __init__(self):
        self.l2: set[bytes] = set()
        self.policy: set[bytes] = set()

    def write_finished(self, keys):
        self.l2.update(keys)  # write-through to L2
        self.policy.update(keys)

    def deleted(self, keys):
        self.policy.difference_update(keys)


def key(i: int) -> bytes:
    return cxlkv.ObjectKey("example-model", 0, i.to_bytes(4, "big")).encode()


def main() -> int:
    controllers = Controllers()
    with cxlkv.Client.connect(sys.argv[1], region_size_bytes=4 << 20) as client:
        layout = client.layout(PAGE_SIZE_BYTES, FINGERPRINT)
        with cxlkv.L1Tier(layout) as tier:
            tier.register_listener(controllers)
            stored = [key(i) for i in range(3)]

            # Store: reserve pages, fill them in place, finish (registers).
            for i, (code, page) in enumerate(tier.reserve_write(stored, [False] * 3, CHUNK_BYTES)):
                assert code == TierCode.SUCCESS, code
                page.memoryview()[:] = bytes([i]) * CHUNK_BYTES
            assert tier.finish_write(stored) == [TierCode.SUCCESS] * 3

            # Promote: an L2 hit loaded into a private temporary, held for reading.
            promoted = [key(100)]
            [(code, page)] = tier.reserve_write(promoted, [True], CHUNK_BYTES)
            page.memoryview()[:] = b"L" * CHUNK_BYTES  # loaded from L2
            [(code, held)] = tier.finish_write_and_reserve_read(promoted)
            assert code == TierCode.SUCCESS and bytes(held) == b"L" * CHUNK_BYTES
            del page, held
            tier.finish_read(promoted)  # the last hold: the private page is reclaimed

            # Read: one hold per tensor-parallel worker, one finish each.
            results = tier.reserve_read(stored, holds=TP_WORKERS)
            intact = all(bytes(p) == bytes([i]) * CHUNK_BYTES for i, (_, p) in enumerate(results))
            del results
            for _ in range(TP_WORKERS):
                tier.finish_read(stored)

            # Evict: the policy deletes when usage passes its watermark.
            used, total = tier.get_memory_usage()
            assert tier.delete(stored) == [TierCode.SUCCESS] * 3
            status = tier.report_status()
            print(
                f"tier (Python): backend {status['backend']}, {used} of {total} bytes used before "
                f"eviction, {len(controllers.l2)} written through, {len(controllers.policy)} left "
                f"in the policy, {status['total_object_count']} staged, bytes "
                f"{'intact' if intact else 'CORRUPT'}"
            )
            ok = intact and len(controllers.l2) == 3 and not controllers.policy
            return 0 if ok and status["total_object_count"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
