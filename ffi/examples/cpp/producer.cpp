// producer (C++): the C producer's job with RAII handles — writes chunks
// into the shared pool through a running cxlkv server, then exits.
//
//   usage: producer SOCKET [COUNT]
#include "cxlkv.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {
constexpr uint64_t kPageSizeBytes = 64 * 1024;
constexpr uint64_t kFingerprint = 0x6578616d706c65ull; // "example"

std::size_t chunk_len(unsigned i) { return 4096u * (i % 4u + 1u) + i; }
uint8_t chunk_byte(unsigned i, std::size_t j) { return static_cast<uint8_t>(i * 31u + j * 7u); }
} // namespace

int main(int argc, char **argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s SOCKET [COUNT]\n", argv[0]);
        return 2;
    }
    unsigned count = argc > 2 ? static_cast<unsigned>(std::strtoul(argv[2], nullptr, 10)) : 16u;
    if (count == 0 || count > 256) {
        std::fprintf(stderr, "producer: COUNT must be 1..256\n");
        return 2;
    }
    try {
        cxlkv_config config = cxlkv::Client::defaults(argv[1]);
        config.region_size_bytes = 4u << 20;
        cxlkv::Client client(config);
        cxlkv::Layout layout = client.layout(kPageSizeBytes, kFingerprint);

        std::vector<std::string> keys;
        for (unsigned i = 0; i < count; i++) {
            keys.push_back("example/chunk/" + std::to_string(i));
        }
        unsigned in_place = count / 2;

        // In place: each lease's page is written where it lies in the pool.
        std::vector<cxlkv::Lease> leases = layout.alloc(in_place);
        for (unsigned i = 0; i < in_place; i++) {
            uint8_t *page = leases[i].data();
            for (std::size_t j = 0; j < chunk_len(i); j++) {
                page[j] = chunk_byte(i, j);
            }
            leases[i].set_len(chunk_len(i));
        }
        std::vector<std::string> first(keys.begin(), keys.begin() + in_place);
        std::vector<cxlkv_register_result> results =
            layout.register_leases(first, std::move(leases));

        // Copied in from ordinary buffers.
        std::vector<std::string> rest(keys.begin() + in_place, keys.end());
        std::vector<std::string> buffers;
        for (unsigned i = in_place; i < count; i++) {
            std::string b(chunk_len(i), '\0');
            for (std::size_t j = 0; j < b.size(); j++) {
                b[j] = static_cast<char>(chunk_byte(i, j));
            }
            buffers.push_back(std::move(b));
        }
        std::vector<std::string_view> values(buffers.begin(), buffers.end());
        for (const auto &r : layout.put(rest, values)) {
            results.push_back(r);
        }

        unsigned inserted = 0, duplicates = 0;
        for (const auto &r : results) {
            if (r.outcome == CXLKV_REGISTER_INSERTED) {
                inserted++;
            } else if (r.outcome == CXLKV_REGISTER_DUPLICATE) {
                duplicates++;
            } else {
                std::fprintf(stderr, "producer: a chunk was rejected (reason %u)\n",
                             static_cast<unsigned>(r.reject_reason));
                return 1;
            }
        }
        std::printf("producer (C++): %u chunks: %u inserted, %u already there\n", count, inserted,
                    duplicates);
        return 0;
    } catch (const cxlkv::Error &e) {
        std::fprintf(stderr, "producer: %s\n", e.what());
        return 1;
    }
}
