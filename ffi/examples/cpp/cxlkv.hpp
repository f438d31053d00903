// cxlkv.hpp — RAII types over the cxlkv C ABI (an example, header-only).
//
// Every handle has exactly one owner: Client, Layout and Lease are
// move-only wrappers that free their handle in the destructor, and a View
// releases its pin when it is destroyed. Failed calls throw cxlkv::Error
// with the status and the library's message.
//
// Lifetimes: a View or Lease may outlive its Layout and Client (the library
// keeps the mapping alive), but a View outliving its Client is no longer
// pinned: another client may delete the key and its page be reused, so
// destroy Views before their Client. A Layout whose Client was destroyed
// fails its calls with CXLKV_STATUS_CLOSED.
#pragma once

#include <cxlkv.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cxlkv {

class Error : public std::runtime_error {
  public:
    Error(cxlkv_status status, const std::string &what)
        : std::runtime_error(what + ": " + cxlkv_status_name(status) + ": " + cxlkv_last_error()),
          status_(status) {}
    cxlkv_status status() const noexcept { return status_; }

  private:
    cxlkv_status status_;
};

inline void check(cxlkv_status status, const char *what) {
    if (status != CXLKV_STATUS_OK) {
        throw Error(status, what);
    }
}

inline cxlkv_bytes bytes(std::string_view s) noexcept {
    return cxlkv_bytes{reinterpret_cast<const uint8_t *>(s.data()), s.size()};
}

inline std::vector<cxlkv_bytes> bytes(const std::vector<std::string> &keys) {
    std::vector<cxlkv_bytes> out;
    out.reserve(keys.size());
    for (const auto &k : keys) {
        out.push_back(bytes(k));
    }
    return out;
}

namespace detail {
struct CloseClient {
    void operator()(cxlkv_client *c) const noexcept { cxlkv_close(c); }
};
struct CloseLayout {
    void operator()(cxlkv_layout *l) const noexcept { cxlkv_layout_close(l); }
};
struct AbortLease {
    void operator()(cxlkv_lease *l) const noexcept { cxlkv_lease_abort(l); }
};
} // namespace detail

// A chunk in place in the shared pool, pinned until destroyed (or reset).
// An empty View stands for an absent key.
class View {
  public:
    View() noexcept : v_() {}
    explicit View(const cxlkv_view &v) noexcept : v_(v) {}
    View(View &&other) noexcept : v_(other.v_) { other.v_ = cxlkv_view(); }
    View &operator=(View &&other) noexcept {
        if (this != &other) {
            reset();
            v_ = other.v_;
            other.v_ = cxlkv_view();
        }
        return *this;
    }
    View(const View &) = delete;
    View &operator=(const View &) = delete;
    ~View() { reset(); }

    explicit operator bool() const noexcept { return v_.guard != nullptr; }
    const uint8_t *data() const noexcept { return v_.data; }
    std::size_t size() const noexcept { return static_cast<std::size_t>(v_.len_bytes); }
    const cxlkv_location &location() const noexcept { return v_.location; }

    // Releases the pin now; data() must not be read afterwards.
    void reset() noexcept {
        if (v_.guard != nullptr) {
            cxlkv_release(&v_);
        }
        v_ = cxlkv_view();
    }

  private:
    cxlkv_view v_;
};

// A writable page not registered yet; aborted (page given back) when
// destroyed unless a Layout registered it.
class Lease {
  public:
    explicit Lease(cxlkv_lease *handle) noexcept : h_(handle) {}

    // The page: write the chunk here, then set_len().
    uint8_t *data() const {
        uint8_t *page = nullptr;
        uint64_t capacity = 0;
        check(cxlkv_lease_data(h_.get(), &page, &capacity), "cxlkv_lease_data");
        return page;
    }
    uint64_t capacity() const {
        uint8_t *page = nullptr;
        uint64_t capacity = 0;
        check(cxlkv_lease_data(h_.get(), &page, &capacity), "cxlkv_lease_data");
        return capacity;
    }
    void set_len(uint64_t len) { check(cxlkv_lease_set_len(h_.get(), len), "cxlkv_lease_set_len"); }
    void write(const void *src, std::size_t len) {
        check(cxlkv_lease_write(h_.get(), static_cast<const uint8_t *>(src), len),
              "cxlkv_lease_write");
    }
    // Hands the handle over (registration consumes it).
    cxlkv_lease *release() noexcept { return h_.release(); }

  private:
    std::unique_ptr<cxlkv_lease, detail::AbortLease> h_;
};

// A layout (page size + fingerprint) of a client.
class Layout {
  public:
    explicit Layout(cxlkv_layout *handle) noexcept : h_(handle) {}

    std::vector<Lease> alloc(std::size_t n) {
        std::vector<cxlkv_lease *> raw(n);
        std::vector<Lease> out;
        out.reserve(n); // nothing below throws once the leases exist
        check(cxlkv_batch_alloc(h_.get(), n, raw.data()), "cxlkv_batch_alloc");
        for (auto *l : raw) {
            out.emplace_back(l);
        }
        return out;
    }

    // Registers written leases (one per key); every lease is consumed,
    // whatever happens — except when the counts differ, which throws
    // std::invalid_argument before anything is passed on.
    std::vector<cxlkv_register_result> register_leases(const std::vector<std::string> &keys,
                                                       std::vector<Lease> &&leases) {
        if (keys.size() != leases.size()) {
            throw std::invalid_argument("cxlkv register_leases: " + std::to_string(keys.size()) +
                                        " keys but " + std::to_string(leases.size()) + " leases");
        }
        std::vector<cxlkv_lease *> raw;
        raw.reserve(leases.size());
        std::vector<cxlkv_register_result> out(keys.size());
        std::vector<cxlkv_bytes> k = bytes(keys);
        for (auto &l : leases) {
            raw.push_back(l.release());
        }
        leases.clear();
        check(cxlkv_batch_register(h_.get(), k.data(), raw.data(), raw.size(), out.data()),
              "cxlkv_batch_register");
        return out;
    }

    // One value per key (else std::invalid_argument).
    std::vector<cxlkv_register_result> put(const std::vector<std::string> &keys,
                                           const std::vector<std::string_view> &values) {
        if (keys.size() != values.size()) {
            throw std::invalid_argument("cxlkv put: " + std::to_string(keys.size()) +
                                        " keys but " + std::to_string(values.size()) + " values");
        }
        std::vector<cxlkv_bytes> k = bytes(keys);
        std::vector<cxlkv_bytes> v;
        v.reserve(values.size());
        for (auto value : values) {
            v.push_back(bytes(value));
        }
        std::vector<cxlkv_register_result> out(keys.size());
        check(cxlkv_batch_put(h_.get(), k.data(), v.data(), k.size(), out.data()),
              "cxlkv_batch_put");
        return out;
    }

    // One round trip; absent keys give empty Views.
    std::vector<View> get(const std::vector<std::string> &keys) {
        std::vector<cxlkv_bytes> k = bytes(keys);
        std::vector<cxlkv_view> raw(k.size());
        std::vector<View> out;
        out.reserve(k.size()); // nothing below throws once the pins are held
        check(cxlkv_batch_get(h_.get(), k.data(), k.size(), raw.data()), "cxlkv_batch_get");
        for (const auto &v : raw) {
            out.emplace_back(v);
        }
        return out;
    }

    std::vector<bool> exists(const std::vector<std::string> &keys) {
        std::vector<cxlkv_bytes> k = bytes(keys);
        std::unique_ptr<bool[]> raw(new bool[k.size()]);
        check(cxlkv_batch_exists(h_.get(), k.data(), k.size(), raw.get()), "cxlkv_batch_exists");
        return std::vector<bool>(raw.get(), raw.get() + k.size());
    }

    std::vector<cxlkv_delete_result> remove(const std::vector<std::string> &keys) {
        std::vector<cxlkv_bytes> k = bytes(keys);
        std::vector<cxlkv_delete_result> out(k.size());
        check(cxlkv_batch_delete(h_.get(), k.data(), k.size(), out.data()), "cxlkv_batch_delete");
        return out;
    }

  private:
    std::unique_ptr<cxlkv_layout, detail::CloseLayout> h_;
};

// A session with the server; closed when destroyed.
class Client {
  public:
    // `config` from Client::defaults(), adjusted.
    explicit Client(const cxlkv_config &config) {
        cxlkv_client *raw = nullptr;
        check(cxlkv_connect(&config, &raw), "cxlkv_connect");
        h_.reset(raw);
    }

    static cxlkv_config defaults(const char *socket_path) {
        cxlkv_config config;
        check(cxlkv_config_init(&config, sizeof config), "cxlkv_config_init");
        config.socket_path = socket_path;
        return config;
    }

    Layout layout(uint64_t page_size_bytes, uint64_t fingerprint) {
        cxlkv_layout *raw = nullptr;
        check(cxlkv_layout_open(h_.get(), page_size_bytes, fingerprint, nullptr, &raw),
              "cxlkv_layout_open");
        return Layout(raw);
    }

    cxlkv_usage usage() const {
        cxlkv_usage u = cxlkv_usage();
        u.size = sizeof u;
        check(cxlkv_query_usage(h_.get(), &u), "cxlkv_query_usage");
        return u;
    }

  private:
    std::unique_ptr<cxlkv_client, detail::CloseClient> h_;
};

} // namespace cxlkv
