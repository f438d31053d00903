// consumer (C++): reads the producer's chunks in place through RAII views
// (each released when it goes out of scope), checks them, deletes them.
//
//   usage: consumer SOCKET [COUNT]
#include "cxlkv.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {
constexpr uint64_t kPageSizeBytes = 64 * 1024;
constexpr uint64_t kFingerprint = 0x6578616d706c65ull;
constexpr auto kWait = std::chrono::seconds(30);

std::size_t chunk_len(unsigned i) { return 4096u * (i % 4u + 1u) + i; }
uint8_t chunk_byte(unsigned i, std::size_t j) { return static_cast<uint8_t>(i * 31u + j * 7u); }

// Region map callback: where an engine would cudaHostRegister the range.
// It may run on several threads at once: the count is atomic.
void on_map(void *user_data, const cxlkv_map_info *) {
    static_cast<std::atomic<unsigned> *>(user_data)->fetch_add(1);
}
} // namespace

int main(int argc, char **argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s SOCKET [COUNT]\n", argv[0]);
        return 2;
    }
    unsigned count = argc > 2 ? static_cast<unsigned>(std::strtoul(argv[2], nullptr, 10)) : 16u;
    if (count == 0 || count > 256) {
        std::fprintf(stderr, "consumer: COUNT must be 1..256\n");
        return 2;
    }
    std::atomic<unsigned> mapped{0};
    try {
        cxlkv_config config = cxlkv::Client::defaults(argv[1]);
        config.map_callbacks.on_map = on_map;
        config.map_callbacks.user_data = &mapped;
        cxlkv::Client client(config);
        cxlkv::Layout layout = client.layout(kPageSizeBytes, kFingerprint);

        std::vector<std::string> keys;
        for (unsigned i = 0; i < count; i++) {
            keys.push_back("example/chunk/" + std::to_string(i));
        }
        auto deadline = std::chrono::steady_clock::now() + kWait;
        for (;;) {
            std::vector<bool> present = layout.exists(keys);
            unsigned found = 0;
            for (bool p : present) {
                found += p ? 1u : 0u;
            }
            if (found == count) {
                break;
            }
            if (std::chrono::steady_clock::now() > deadline) {
                std::fprintf(stderr, "consumer: only %u of %u keys in time\n", found, count);
                return 1;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }

        unsigned good = 0;
        std::size_t bytes = 0;
        {
            std::vector<cxlkv::View> views = layout.get(keys);
            for (unsigned i = 0; i < count; i++) {
                const cxlkv::View &v = views[i];
                bool ok = v && v.size() == chunk_len(i);
                for (std::size_t j = 0; ok && j < v.size(); j++) {
                    ok = v.data()[j] == chunk_byte(i, j);
                }
                good += ok ? 1u : 0u;
                bytes += v.size();
            }
        } // every view released here

        unsigned gone = 0;
        for (const auto &d : layout.remove(keys)) {
            gone += d.outcome == CXLKV_DELETE_DELETED ? 1u : 0u;
        }
        std::printf("consumer (C++): %u of %u chunks intact (%zu bytes read in place, %u regions "
                    "mapped), %u deleted\n",
                    good, count, bytes, mapped.load(), gone);
        return good == count && gone == count ? 0 : 1;
    } catch (const cxlkv::Error &e) {
        std::fprintf(stderr, "consumer: %s\n", e.what());
        return 1;
    }
}
