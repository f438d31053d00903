/*
 * api_test: every exported function of libcxlkv, from C, including the
 * error paths — NULL pointers, zero and oversized lengths, NULL, freed,
 * foreign and garbage handles, bad struct sizes — each of which must give
 * a status (never a crash). scripts/test-ffi.sh builds it with -Wall
 * -Wextra -Werror, runs it against a real server, and again under
 * AddressSanitizer; it also checks that every symbol the library exports
 * is called here.
 *
 *   usage: api_test SOCKET
 */
#define _POSIX_C_SOURCE 200809L

#include <cxlkv.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PAGE_SIZE_BYTES (64u * 1024u)
#define FINGERPRINT 0x7465737400ull

static int failures;

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, \
                    #cond, cxlkv_last_error());                                            \
            failures++;                                                                    \
        }                                                                                  \
    } while (0)

#define EXPECT(call, want)                                                                  \
    do {                                                                                    \
        cxlkv_status got_ = (call);                                                         \
        if (got_ != (want)) {                                                               \
            fprintf(stderr, "%s:%d: %s = %s, expected %s; last error: %s\n", __FILE__,      \
                    __LINE__, #call, cxlkv_status_name(got_), cxlkv_status_name(want),      \
                    cxlkv_last_error());                                                    \
            failures++;                                                                     \
        }                                                                                   \
    } while (0)

#define OK(call) EXPECT(call, CXLKV_STATUS_OK)

static const char *socket_path;

static cxlkv_bytes key_of(const char *s) {
    cxlkv_bytes b = {(const uint8_t *)s, strlen(s)};
    return b;
}

static cxlkv_config config_for_tests(void) {
    cxlkv_config c;
    OK(cxlkv_config_init(&c, sizeof c));
    c.socket_path = socket_path;
    c.region_size_bytes = 4u << 20;
    return c;
}

static void test_version_status_and_last_error(void) {
    CHECK(cxlkv_abi_version() >> 16 == CXLKV_ABI_VERSION_MAJOR);
    CHECK((cxlkv_abi_version() & 0xFFFFu) >= CXLKV_ABI_VERSION_MINOR);
    CHECK(strlen(cxlkv_version()) > 0);
    CHECK(strcmp(cxlkv_status_name(CXLKV_STATUS_OK), "OK") == 0);
    CHECK(strcmp(cxlkv_status_name(CXLKV_STATUS_BAD_HANDLE), "BAD_HANDLE") == 0);
    CHECK(strcmp(cxlkv_status_name(CXLKV_STATUS_SERVER_REGION_NOT_EMPTY),
                 "SERVER_REGION_NOT_EMPTY") == 0);
    CHECK(strcmp(cxlkv_status_name(-5), "UNKNOWN") == 0);
    CHECK(CXLKV_STATUS_SERVER_KEY_TOO_LONG == 100 + 4);

    EXPECT(cxlkv_config_init(NULL, sizeof(cxlkv_config)), CXLKV_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(cxlkv_last_error(), "cxlkv_config_init") != NULL);
    CHECK(strstr(cxlkv_last_error(), "NULL") != NULL);
    cxlkv_config c;
    OK(cxlkv_config_init(&c, sizeof c));
    CHECK(strcmp(cxlkv_last_error(), "") == 0); /* success clears it */
}

static void *other_thread(void *arg) {
    (void)arg;
    /* Each thread has its own message. */
    CHECK(strcmp(cxlkv_last_error(), "") == 0);
    EXPECT(cxlkv_flush_unpins(NULL), CXLKV_STATUS_BAD_HANDLE);
    CHECK(strstr(cxlkv_last_error(), "cxlkv_flush_unpins") != NULL);
    return NULL;
}

static void test_last_error_is_per_thread(void) {
    EXPECT(cxlkv_config_init(NULL, 0), CXLKV_STATUS_INVALID_ARGUMENT);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, other_thread, NULL) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(strstr(cxlkv_last_error(), "cxlkv_config_init") != NULL);
}

static void test_config_sizes_and_fields(void) {
    cxlkv_config c;
    EXPECT(cxlkv_config_init(&c, 4), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_config_init(&c, 1u << 20), CXLKV_STATUS_INVALID_ARGUMENT);
    cxlkv_layout_options o;
    EXPECT(cxlkv_layout_options_init(&o, 3), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_layout_options_init(NULL, sizeof o), CXLKV_STATUS_INVALID_ARGUMENT);
    OK(cxlkv_layout_options_init(&o, sizeof o));
    CHECK(o.size == sizeof o && o.flags == 0);

    cxlkv_client *client = (cxlkv_client *)0x1;
    c = config_for_tests();
    EXPECT(cxlkv_connect(&c, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_connect(NULL, &client), CXLKV_STATUS_INVALID_ARGUMENT);
    CHECK(client == NULL); /* cleared before anything else failed */

    c.socket_path = NULL;
    EXPECT(cxlkv_connect(&c, &client), CXLKV_STATUS_INVALID_ARGUMENT);
    c = config_for_tests();
    c.flags = 1u << 20;
    EXPECT(cxlkv_connect(&c, &client), CXLKV_STATUS_INVALID_ARGUMENT);
    c = config_for_tests();
    c.visibility = 42;
    EXPECT(cxlkv_connect(&c, &client), CXLKV_STATUS_INVALID_ARGUMENT);
    c = config_for_tests();
    c.request_timeout_ms = 0;
    EXPECT(cxlkv_connect(&c, &client), CXLKV_STATUS_CONFIG);
    CHECK(strstr(cxlkv_last_error(), "request_timeout_ms") != NULL);
    c = config_for_tests();
    c.size = 8;
    EXPECT(cxlkv_connect(&c, &client), CXLKV_STATUS_INVALID_ARGUMENT);
    c = config_for_tests();
    c.socket_path = "/nonexistent/cxlkv.sock";
    c.request_timeout_ms = 200;
    EXPECT(cxlkv_connect(&c, &client), CXLKV_STATUS_CONNECT);

    /* A newer header's larger struct: accepted while its extra fields are
     * zero, refused once one is set. */
    struct {
        cxlkv_config base;
        uint64_t field_from_the_future;
    } newer;
    OK(cxlkv_config_init(&newer.base, sizeof newer));
    CHECK(newer.base.size == sizeof newer && newer.field_from_the_future == 0);
    newer.base.socket_path = socket_path;
    OK(cxlkv_connect(&newer.base, &client));
    OK(cxlkv_close(client));
    newer.field_from_the_future = 7;
    EXPECT(cxlkv_connect(&newer.base, &client), CXLKV_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(cxlkv_last_error(), "does not know") != NULL);
}

static void test_bad_handles(cxlkv_client *client, cxlkv_layout *layout) {
    cxlkv_client *garbage_client = (cxlkv_client *)(uintptr_t)0xdeadbeef;
    cxlkv_layout *garbage_layout = (cxlkv_layout *)(uintptr_t)0x12345678;
    cxlkv_layout *foreign = (cxlkv_layout *)client; /* a client is not a layout */
    bool present = false;
    cxlkv_bytes k = key_of("k");

    EXPECT(cxlkv_exists(NULL, k.data, k.len, &present), CXLKV_STATUS_BAD_HANDLE);
    EXPECT(cxlkv_exists(garbage_layout, k.data, k.len, &present), CXLKV_STATUS_BAD_HANDLE);
    EXPECT(cxlkv_exists(foreign, k.data, k.len, &present), CXLKV_STATUS_BAD_HANDLE);
    CHECK(strstr(cxlkv_last_error(), "client handle") != NULL);
    EXPECT(cxlkv_flush_unpins(garbage_client), CXLKV_STATUS_BAD_HANDLE);
    EXPECT(cxlkv_flush_unpins((cxlkv_client *)layout), CXLKV_STATUS_BAD_HANDLE);

    /* A freed handle stays refused, also after its slot is reused. */
    cxlkv_layout *second = NULL;
    OK(cxlkv_layout_open(client, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &second));
    OK(cxlkv_layout_close(second));
    EXPECT(cxlkv_exists(second, k.data, k.len, &present), CXLKV_STATUS_BAD_HANDLE);
    CHECK(strstr(cxlkv_last_error(), "already freed") != NULL);
    EXPECT(cxlkv_layout_close(second), CXLKV_STATUS_BAD_HANDLE);
    cxlkv_layout *third = NULL;
    OK(cxlkv_layout_open(client, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &third));
    EXPECT(cxlkv_exists(second, k.data, k.len, &present), CXLKV_STATUS_BAD_HANDLE);
    OK(cxlkv_exists(third, k.data, k.len, &present));
    OK(cxlkv_layout_close(third));

    /* Freeing NULL is a no-op, like free(). */
    OK(cxlkv_close(NULL));
    OK(cxlkv_layout_close(NULL));
    OK(cxlkv_lease_abort(NULL));
    OK(cxlkv_remove_map_observer(NULL));

    /* Every other entry point with a garbage handle. */
    cxlkv_lease *garbage_lease = (cxlkv_lease *)(uintptr_t)0x77;
    uint8_t *data = NULL;
    uint64_t cap = 0;
    EXPECT(cxlkv_lease_data(garbage_lease, &data, &cap), CXLKV_STATUS_BAD_HANDLE);
    EXPECT(cxlkv_lease_set_len(garbage_lease, 1), CXLKV_STATUS_BAD_HANDLE);
    EXPECT(cxlkv_lease_write(garbage_lease, k.data, k.len), CXLKV_STATUS_BAD_HANDLE);
    EXPECT(cxlkv_lease_abort(garbage_lease), CXLKV_STATUS_BAD_HANDLE);
    cxlkv_view view = {0};
    view.guard = (cxlkv_guard *)(uintptr_t)0x99;
    EXPECT(cxlkv_release(&view), CXLKV_STATUS_BAD_HANDLE);
    cxlkv_usage usage = {sizeof usage, 0, 0, 0, 0, 0};
    EXPECT(cxlkv_query_usage(garbage_client, &usage), CXLKV_STATUS_BAD_HANDLE);
    cxlkv_layout *l = NULL;
    EXPECT(cxlkv_layout_open(garbage_client, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &l),
           CXLKV_STATUS_BAD_HANDLE);
    CHECK(l == NULL);
}

static void test_null_and_length_arguments(cxlkv_layout *layout) {
    cxlkv_bytes k = key_of("k");
    bool present = false;
    cxlkv_register_result r;
    cxlkv_delete_result d;
    cxlkv_view v;
    static uint8_t too_long[600];
    memset(too_long, 'x', sizeof too_long);

    EXPECT(cxlkv_exists(layout, NULL, 1, &present), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_exists(layout, k.data, k.len, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_exists(layout, k.data, 0, &present), CXLKV_STATUS_KEY_LENGTH);
    EXPECT(cxlkv_exists(layout, too_long, sizeof too_long, &present), CXLKV_STATUS_KEY_LENGTH);
    EXPECT(cxlkv_get(layout, k.data, 0, &v), CXLKV_STATUS_KEY_LENGTH);
    CHECK(v.guard == NULL && v.data == NULL); /* zeroed on failure */
    EXPECT(cxlkv_get(layout, k.data, k.len, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_delete(layout, k.data, k.len, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_delete(layout, NULL, 0, &d), CXLKV_STATUS_KEY_LENGTH);
    EXPECT(cxlkv_put(layout, k.data, k.len, NULL, 10, &r), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_put(layout, k.data, k.len, k.data, 0, &r), CXLKV_STATUS_CHUNK_LENGTH);
    EXPECT(cxlkv_put(layout, k.data, k.len, k.data, k.len, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    /* Longer than any page: refused before the bytes are read. */
    EXPECT(cxlkv_put(layout, k.data, k.len, k.data, (size_t)1 << 40, &r),
           CXLKV_STATUS_CHUNK_LENGTH);

    /* Batches: NULL arrays, oversized counts (refused before the array is
     * read), and empty batches (no-ops). */
    cxlkv_bytes keys[2] = {key_of("a"), key_of("b")};
    bool presents[2];
    EXPECT(cxlkv_batch_exists(layout, NULL, 2, presents), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_batch_exists(layout, keys, 2, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_batch_exists(layout, keys, (size_t)1 << 40, presents),
           CXLKV_STATUS_BATCH_TOO_LARGE);
    OK(cxlkv_batch_exists(layout, NULL, 0, NULL));
    OK(cxlkv_batch_get(layout, NULL, 0, NULL));
    OK(cxlkv_batch_delete(layout, NULL, 0, NULL));
    OK(cxlkv_batch_put(layout, NULL, NULL, 0, NULL));
    OK(cxlkv_batch_register(layout, NULL, NULL, 0, NULL));
    OK(cxlkv_batch_alloc(layout, 0, NULL));
    OK(cxlkv_batch_release(NULL, 0));
    EXPECT(cxlkv_batch_release(NULL, 2), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_release(NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    cxlkv_bytes holes[2] = {{NULL, 3}, key_of("b")};
    EXPECT(cxlkv_batch_exists(layout, holes, 2, presents), CXLKV_STATUS_INVALID_ARGUMENT);
    cxlkv_lease *leases[2];
    EXPECT(cxlkv_batch_alloc(layout, 5000, leases), CXLKV_STATUS_BATCH_TOO_LARGE);
    EXPECT(cxlkv_alloc(layout, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    /* A misaligned output array. */
    uint64_t storage[8];
    cxlkv_view *misaligned = (cxlkv_view *)((char *)storage + 1);
    EXPECT(cxlkv_batch_get(layout, keys, 1, misaligned), CXLKV_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(cxlkv_last_error(), "aligned") != NULL);

    cxlkv_layout_info info = {0};
    info.size = 4;
    EXPECT(cxlkv_query_layout(layout, &info), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_query_layout(layout, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
}

static void test_put_get_exists_delete(cxlkv_layout *layout) {
    enum { N = 6 };
    static char names[N][32];
    static uint8_t chunks[N][5000];
    cxlkv_bytes keys[N + 1], values[N];
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "api-test/%d", i);
        keys[i] = key_of(names[i]);
        memset(chunks[i], 'a' + i, sizeof chunks[i]);
        values[i].data = chunks[i];
        values[i].len = 1000u + (size_t)i;
    }
    keys[N] = key_of("api-test/absent");

    cxlkv_register_result results[N];
    OK(cxlkv_batch_put(layout, keys, values, N, results));
    for (int i = 0; i < N; i++) {
        CHECK(results[i].outcome == CXLKV_REGISTER_INSERTED);
        CHECK(results[i].reject_reason == CXLKV_REJECT_NONE);
    }
    /* Again: duplicates, naming the first chunk. */
    cxlkv_register_result again;
    OK(cxlkv_put(layout, keys[0].data, keys[0].len, values[1].data, values[1].len, &again));
    CHECK(again.outcome == CXLKV_REGISTER_DUPLICATE);
    CHECK(again.winner.len_bytes == values[0].len);

    bool present[N + 1];
    OK(cxlkv_batch_exists(layout, keys, N + 1, present));
    for (int i = 0; i < N; i++) {
        CHECK(present[i]);
    }
    CHECK(!present[N]);

    cxlkv_view views[N + 1];
    OK(cxlkv_batch_get(layout, keys, N + 1, views));
    for (int i = 0; i < N; i++) {
        CHECK(views[i].guard != NULL);
        CHECK(views[i].len_bytes == values[i].len);
        CHECK(memcmp(views[i].data, chunks[i], values[i].len) == 0);
    }
    CHECK(views[N].guard == NULL && views[N].data == NULL && views[N].len_bytes == 0);

    cxlkv_view single;
    OK(cxlkv_get(layout, keys[0].data, keys[0].len, &single));
    CHECK(single.guard != NULL && single.guard != views[0].guard);
    CHECK(single.data == views[0].data); /* the same bytes in the pool */
    cxlkv_view copy = single;
    OK(cxlkv_release(&single));
    CHECK(single.guard == NULL && single.data == NULL); /* zeroed */
    OK(cxlkv_release(&single));                         /* absent: a no-op */
    EXPECT(cxlkv_release(&copy), CXLKV_STATUS_BAD_HANDLE); /* released twice */

    cxlkv_delete_result d;
    OK(cxlkv_delete(layout, keys[0].data, keys[0].len, &d));
    CHECK(d.outcome == CXLKV_DELETE_PINNED && d.pins >= 1);

    OK(cxlkv_batch_release(views, N + 1));
    for (int i = 0; i < N + 1; i++) {
        CHECK(views[i].guard == NULL);
    }
    cxlkv_delete_result ds[N + 1];
    OK(cxlkv_batch_delete(layout, keys, N + 1, ds));
    for (int i = 0; i < N; i++) {
        CHECK(ds[i].outcome == CXLKV_DELETE_DELETED);
    }
    CHECK(ds[N].outcome == CXLKV_DELETE_MISSING);
    bool one = true;
    OK(cxlkv_exists(layout, keys[0].data, keys[0].len, &one));
    CHECK(!one);
}

static void test_leases(cxlkv_layout *layout) {
    cxlkv_layout_info before = {0};
    before.size = sizeof before;
    OK(cxlkv_query_layout(layout, &before));
    CHECK(before.page_size_bytes == PAGE_SIZE_BYTES && before.fingerprint == FINGERPRINT);

    cxlkv_lease *lease = NULL;
    OK(cxlkv_alloc(layout, &lease));
    uint8_t *page = NULL;
    uint64_t cap = 0;
    EXPECT(cxlkv_lease_data(lease, NULL, &cap), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_lease_data(lease, &page, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    OK(cxlkv_lease_data(lease, &page, &cap));
    CHECK(page != NULL && cap == PAGE_SIZE_BYTES);
    memset(page, 0x5A, 3000);
    EXPECT(cxlkv_lease_set_len(lease, PAGE_SIZE_BYTES + 1), CXLKV_STATUS_CHUNK_LENGTH);
    OK(cxlkv_lease_set_len(lease, 3000));
    cxlkv_bytes k = key_of("api-test/lease");
    cxlkv_register_result r;
    OK(cxlkv_register(layout, k.data, k.len, lease, &r));
    CHECK(r.outcome == CXLKV_REGISTER_INSERTED);
    /* Consumed by the registration. */
    EXPECT(cxlkv_lease_set_len(lease, 1), CXLKV_STATUS_BAD_HANDLE);
    EXPECT(cxlkv_lease_abort(lease), CXLKV_STATUS_BAD_HANDLE);

    cxlkv_view v;
    OK(cxlkv_get(layout, k.data, k.len, &v));
    CHECK(v.len_bytes == 3000 && v.data[0] == 0x5A && v.data[2999] == 0x5A);
    OK(cxlkv_release(&v));

    /* Batch: write through cxlkv_lease_write; one bad handle in the batch
     * fails the call and every valid lease is still consumed. */
    cxlkv_lease *leases[3];
    OK(cxlkv_batch_alloc(layout, 3, leases));
    const char *text = "written by cxlkv_lease_write";
    for (int i = 0; i < 3; i++) {
        OK(cxlkv_lease_write(leases[i], (const uint8_t *)text, strlen(text)));
    }
    EXPECT(cxlkv_lease_write(leases[0], NULL, 4), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_lease_write(leases[0], (const uint8_t *)text, 0), CXLKV_STATUS_CHUNK_LENGTH);
    OK(cxlkv_lease_abort(leases[2]));
    cxlkv_bytes keys[3] = {key_of("api-test/l0"), key_of("api-test/l1"), key_of("api-test/l2")};
    cxlkv_register_result rs[3];
    EXPECT(cxlkv_batch_register(layout, keys, leases, 3, rs), CXLKV_STATUS_BAD_HANDLE);
    CHECK(strstr(cxlkv_last_error(), "leases[2]") != NULL);
    EXPECT(cxlkv_lease_abort(leases[0]), CXLKV_STATUS_BAD_HANDLE); /* consumed */
    bool present[3];
    OK(cxlkv_batch_exists(layout, keys, 3, present));
    CHECK(!present[0] && !present[1] && !present[2]);

    /* Registering empty chunks is refused, and consumes the lease too. */
    OK(cxlkv_alloc(layout, &lease));
    EXPECT(cxlkv_register(layout, keys[0].data, keys[0].len, lease, &r),
           CXLKV_STATUS_CHUNK_LENGTH);
    EXPECT(cxlkv_lease_abort(lease), CXLKV_STATUS_BAD_HANDLE);

    OK(cxlkv_batch_alloc(layout, 2, leases));
    OK(cxlkv_lease_write(leases[0], (const uint8_t *)text, 5));
    OK(cxlkv_lease_write(leases[1], (const uint8_t *)text, 6));
    OK(cxlkv_batch_register(layout, keys, leases, 2, rs));
    CHECK(rs[0].outcome == CXLKV_REGISTER_INSERTED && rs[1].outcome == CXLKV_REGISTER_INSERTED);

    cxlkv_layout_info after = {0};
    after.size = sizeof after;
    OK(cxlkv_query_layout(layout, &after));
    CHECK(after.refused_frees == before.refused_frees); /* no wrong free anywhere */

    cxlkv_delete_result ds[3];
    keys[2] = k;
    OK(cxlkv_batch_delete(layout, keys, 3, ds));
    for (int i = 0; i < 3; i++) {
        CHECK(ds[i].outcome == CXLKV_DELETE_DELETED);
    }
}

static void test_layouts(cxlkv_client *client) {
    cxlkv_layout_options o;
    OK(cxlkv_layout_options_init(&o, sizeof o));
    o.flags = CXLKV_CONFIG_NO_AUTO_EXPAND;
    o.initial_reservation_bytes = 0;
    cxlkv_layout *fixed = NULL;
    OK(cxlkv_layout_open(client, 2 * PAGE_SIZE_BYTES, FINGERPRINT + 1, &o, &fixed));
    cxlkv_lease *lease = NULL;
    /* No regions and no expansion: out of memory. */
    EXPECT(cxlkv_alloc(fixed, &lease), CXLKV_STATUS_OUT_OF_MEMORY);
    CHECK(lease == NULL);
    OK(cxlkv_layout_close(fixed));

    o.flags = 1u << 30;
    EXPECT(cxlkv_layout_open(client, PAGE_SIZE_BYTES, 9, &o, &fixed), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_layout_open(client, 1000, 9, NULL, &fixed), CXLKV_STATUS_INVALID_PAGE_SIZE);
    EXPECT(cxlkv_layout_open(client, PAGE_SIZE_BYTES, 9, NULL, NULL),
           CXLKV_STATUS_INVALID_ARGUMENT);
}

static unsigned maps, unmaps;
static void count_map(void *user_data, const cxlkv_map_info *info) {
    CHECK(user_data == &maps && info != NULL && info->base != NULL && info->len_bytes > 0);
    __atomic_fetch_add(&maps, 1, __ATOMIC_SEQ_CST);
}
static void count_unmap(void *user_data, const cxlkv_map_info *info) {
    CHECK(user_data == &maps && info != NULL);
    __atomic_fetch_add(&unmaps, 1, __ATOMIC_SEQ_CST);
}

static void test_stats_and_observers(void) {
    cxlkv_config c = config_for_tests();
    cxlkv_client *client = NULL;
    OK(cxlkv_connect(&c, &client));
    cxlkv_map_callbacks cbs = {count_map, count_unmap, &maps};
    cxlkv_observer *observer = NULL;
    EXPECT(cxlkv_add_map_observer(client, NULL, &observer), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_add_map_observer(client, &cbs, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    cxlkv_map_callbacks none = {NULL, NULL, NULL};
    EXPECT(cxlkv_add_map_observer(client, &none, &observer), CXLKV_STATUS_INVALID_ARGUMENT);
    OK(cxlkv_add_map_observer(client, &cbs, &observer));

    cxlkv_layout *layout = NULL;
    OK(cxlkv_layout_open(client, PAGE_SIZE_BYTES, FINGERPRINT + 2, NULL, &layout));
    cxlkv_bytes k = key_of("api-test/stats");
    cxlkv_register_result r;
    OK(cxlkv_put(layout, k.data, k.len, k.data, k.len, &r)); /* maps a region */
    CHECK(maps == 1);

    cxlkv_client_stats stats = {0};
    stats.size = sizeof stats;
    OK(cxlkv_query_stats(client, &stats));
    CHECK(stats.size == sizeof stats && stats.requests >= 2 && stats.regions_acquired == 1);
    EXPECT(cxlkv_query_stats(client, NULL), CXLKV_STATUS_INVALID_ARGUMENT);

    cxlkv_usage usage = {0};
    usage.size = sizeof usage;
    OK(cxlkv_query_usage(client, &usage));
    CHECK(usage.instance_used_bytes == PAGE_SIZE_BYTES && usage.instance_owned_bytes > 0);

    cxlkv_session_info session = {0};
    session.size = sizeof session;
    OK(cxlkv_query_session(client, &session));
    CHECK(session.session_id != 0 && session.owned_keys == 1);

    cxlkv_directory_stats dir = {0};
    dir.size = sizeof dir;
    OK(cxlkv_query_directory(client, &dir));
    CHECK(dir.keys >= 1 && dir.sessions >= 1 && dir.inserted >= 1);

    char id[256];
    size_t len = 0;
    OK(cxlkv_instance_id(client, id, sizeof id, &len));
    CHECK(len > 0 && strlen(id) == len);
    char tiny[2];
    size_t needed = 0;
    EXPECT(cxlkv_instance_id(client, tiny, sizeof tiny, &needed), CXLKV_STATUS_BUFFER_TOO_SMALL);
    CHECK(needed == len);
    EXPECT(cxlkv_instance_id(client, id, sizeof id, NULL), CXLKV_STATUS_INVALID_ARGUMENT);

    size_t mapped = 99;
    OK(cxlkv_map_all_regions(client, &mapped));
    CHECK(mapped < 99);
    EXPECT(cxlkv_map_all_regions(client, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    OK(cxlkv_flush_unpins(client));

    cxlkv_delete_result d;
    OK(cxlkv_delete(layout, k.data, k.len, &d));
    OK(cxlkv_remove_map_observer(observer));
    EXPECT(cxlkv_remove_map_observer(observer), CXLKV_STATUS_BAD_HANDLE);
    OK(cxlkv_layout_close(layout));
    OK(cxlkv_close(client));
    /* Every region it was told about (its own, and any of other instances
     * that cxlkv_map_all_regions mapped) reported its unmapping, also after
     * the observer was removed. */
    CHECK(maps >= 1 && unmaps == maps);
}

static void test_closed_client(void) {
    cxlkv_config c = config_for_tests();
    cxlkv_client *client = NULL;
    cxlkv_layout *layout = NULL;
    OK(cxlkv_connect(&c, &client));
    OK(cxlkv_layout_open(client, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &layout));
    OK(cxlkv_close(client));
    bool present;
    cxlkv_bytes k = key_of("k");
    EXPECT(cxlkv_exists(layout, k.data, k.len, &present), CXLKV_STATUS_CLOSED);
    EXPECT(cxlkv_close(client), CXLKV_STATUS_BAD_HANDLE); /* closed twice */
    OK(cxlkv_layout_close(layout));
}

/* A forked child inherits the parent's handles but may not use them: every
 * call refuses them (BAD_HANDLE, saying why), the freeing ones included, so
 * the child's exit cannot end the parent's session and drop the pins of
 * the views the parent still reads. A client the child connects works. */
static void test_handles_do_not_cross_fork(void) {
    cxlkv_config c = config_for_tests();
    cxlkv_client *client = NULL, *other = NULL;
    cxlkv_layout *layout = NULL, *other_layout = NULL;
    OK(cxlkv_connect(&c, &client));
    OK(cxlkv_layout_open(client, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &layout));
    OK(cxlkv_connect(&c, &other));
    OK(cxlkv_layout_open(other, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &other_layout));
    cxlkv_bytes k = key_of("fork/pinned-by-the-parent");
    cxlkv_register_result r;
    OK(cxlkv_put(layout, k.data, k.len, (const uint8_t *)"parent", 6, &r));
    cxlkv_view view;
    OK(cxlkv_get(layout, k.data, k.len, &view));
    CHECK(view.guard != NULL);
    cxlkv_session_info before = {.size = sizeof before}, after = {.size = sizeof after};
    OK(cxlkv_query_session(client, &before));

    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int bad = 0;
        bool present = false;
        bad += cxlkv_exists(layout, k.data, k.len, &present) != CXLKV_STATUS_BAD_HANDLE;
        bad += strstr(cxlkv_last_error(), "forked") == NULL;
        bad += cxlkv_release(&view) != CXLKV_STATUS_BAD_HANDLE;
        bad += cxlkv_layout_close(layout) != CXLKV_STATUS_BAD_HANDLE;
        bad += cxlkv_close(client) != CXLKV_STATUS_BAD_HANDLE;
        cxlkv_client *mine = NULL;
        cxlkv_layout *mine_layout = NULL;
        bad += cxlkv_connect(&c, &mine) != CXLKV_STATUS_OK;
        bad += cxlkv_layout_open(mine, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &mine_layout) !=
               CXLKV_STATUS_OK;
        bad += cxlkv_exists(mine_layout, k.data, k.len, &present) != CXLKV_STATUS_OK || !present;
        bad += cxlkv_layout_close(mine_layout) != CXLKV_STATUS_OK;
        bad += cxlkv_close(mine) != CXLKV_STATUS_OK;
        if (bad != 0) {
            fprintf(stderr, "api_test (forked child): %d check(s) failed; last error: %s\n", bad,
                    cxlkv_last_error());
        }
        _exit(bad == 0 ? 0 : 1);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);

    /* The parent's session and its pin are what they were. */
    OK(cxlkv_query_session(client, &after));
    CHECK(after.session_id == before.session_id);
    cxlkv_delete_result d;
    OK(cxlkv_delete(other_layout, k.data, k.len, &d));
    CHECK(d.outcome == CXLKV_DELETE_PINNED);
    CHECK(view.len_bytes == 6 && memcmp(view.data, "parent", 6) == 0);
    OK(cxlkv_release(&view));
    OK(cxlkv_flush_unpins(client));
    OK(cxlkv_delete(other_layout, k.data, k.len, &d));
    CHECK(d.outcome == CXLKV_DELETE_DELETED);
    OK(cxlkv_layout_close(other_layout));
    OK(cxlkv_close(other));
    OK(cxlkv_layout_close(layout));
    OK(cxlkv_close(client));
}

/* --- the L1 tier ---------------------------------------------------------- */

/* What the listener and the event sink heard. */
static struct {
    unsigned calls[7];
    unsigned events[7];
    unsigned last_n[7];
    cxlkv_tier *tier;
    cxlkv_status reentrant;
    cxlkv_status lock_free;
} heard;

#define LISTENER_FN(name, slot)                                                  \
    static void name(void *user_data, const cxlkv_bytes *keys, size_t n) {      \
        CHECK(user_data == &heard);                                              \
        CHECK(n == 0 || (keys != NULL && keys[0].data != NULL && keys[0].len > 0)); \
        heard.calls[slot]++;                                                     \
        heard.last_n[slot] = (unsigned)n;                                        \
    }
LISTENER_FN(on_reserved_read, 0)
LISTENER_FN(on_read_finished, 1)
LISTENER_FN(on_reserved_write, 2)
LISTENER_FN(on_finish_write_and_reserve_read, 4)
LISTENER_FN(on_deleted, 5)
LISTENER_FN(on_accessed, 6)

/* write_finished also calls back into the tier: a locked operation is
 * refused (no deadlock), a lock-free one answered. */
static void on_write_finished(void *user_data, const cxlkv_bytes *keys, size_t n) {
    CHECK(user_data == &heard);
    (void)keys;
    heard.calls[3]++;
    heard.last_n[3] = (unsigned)n;
    cxlkv_tier_status st = {0};
    st.size = sizeof st;
    heard.reentrant = cxlkv_tier_report_status(heard.tier, &st);
    bool evictable;
    heard.lock_free = cxlkv_tier_is_key_evictable(heard.tier, (const uint8_t *)"x", 1, &evictable);
}

static void on_event(void *user_data, uint32_t event, const cxlkv_bytes *keys, size_t n) {
    CHECK(user_data == &heard);
    CHECK(event >= CXLKV_TIER_EVENT_READ_RESERVED && event <= CXLKV_TIER_EVENT_KEYS_EVICTED);
    (void)keys;
    (void)n;
    heard.events[event]++;
}

static void test_tier(cxlkv_layout *layout) {
    cxlkv_tier_config cfg;
    EXPECT(cxlkv_tier_config_init(&cfg, 3), CXLKV_STATUS_INVALID_ARGUMENT);
    OK(cxlkv_tier_config_init(&cfg, sizeof cfg));
    CHECK(cfg.write_ttl_ms == 600000 && cfg.read_ttl_ms == 300000);
    cfg.on_event = on_event;
    cfg.event_user_data = &heard;

    cxlkv_tier *tier = (cxlkv_tier *)0x1;
    EXPECT(cxlkv_tier_open(NULL, &cfg, &tier), CXLKV_STATUS_BAD_HANDLE);
    CHECK(tier == NULL);
    EXPECT(cxlkv_tier_open(layout, &cfg, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    cfg.write_ttl_ms = 0;
    EXPECT(cxlkv_tier_open(layout, &cfg, &tier), CXLKV_STATUS_CONFIG);
    cfg.write_ttl_ms = 600000;
    OK(cxlkv_tier_open(layout, &cfg, &tier));
    heard.tier = tier;

    cxlkv_tier_listener listener = {sizeof listener, 0, on_reserved_read, on_read_finished,
                                    on_reserved_write, on_write_finished,
                                    on_finish_write_and_reserve_read, on_deleted, on_accessed,
                                    &heard};
    EXPECT(cxlkv_tier_register_listener(tier, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    OK(cxlkv_tier_register_listener(tier, &listener));

    cxlkv_bytes keys[4] = {key_of("tier/retained-a"), key_of("tier/retained-b"),
                           key_of("tier/temp-a"), key_of("tier/absent")};
    uint8_t temporary[3] = {0, 0, 1};
    cxlkv_tier_page pages[4];
    cxlkv_tier_code codes[4];

    /* Write: reserve, fill in place, finish (retained) or promote (temp). */
    EXPECT(cxlkv_tier_reserve_write(tier, keys, temporary, 3, 3000, CXLKV_TIER_WRITE_UPDATE, pages),
           CXLKV_STATUS_TIER_UNSUPPORTED_MODE);
    EXPECT(cxlkv_tier_reserve_write(tier, keys, temporary, 3, 3000, 77, pages),
           CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_tier_reserve_write(tier, keys, NULL, 3, 3000, CXLKV_TIER_WRITE_NEW, pages),
           CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_tier_reserve_write(tier, keys, temporary, 3, PAGE_SIZE_BYTES + 1,
                                    CXLKV_TIER_WRITE_NEW, pages),
           CXLKV_STATUS_CHUNK_LENGTH);
    OK(cxlkv_tier_reserve_write(tier, keys, temporary, 3, 3000, CXLKV_TIER_WRITE_NEW, pages));
    for (int i = 0; i < 3; i++) {
        CHECK(pages[i].code == CXLKV_TIER_SUCCESS && pages[i].data != NULL);
        CHECK(pages[i].len_bytes == 3000 && pages[i].page_size_bytes == PAGE_SIZE_BYTES);
        memset(pages[i].data, 'A' + i, 3000);
    }
    OK(cxlkv_tier_reserve_write(tier, keys, temporary, 1, 3000, CXLKV_TIER_WRITE_NEW, pages));
    CHECK(pages[0].code == CXLKV_TIER_KEY_NOT_WRITABLE && pages[0].data == NULL);
    bool flag = true;
    OK(cxlkv_tier_is_key_evictable(tier, keys[0].data, keys[0].len, &flag));
    CHECK(!flag); /* write-staged */
    cxlkv_tier_key_stage stage = {0};
    stage.size = sizeof stage;
    OK(cxlkv_tier_inspect(tier, keys[2].data, keys[2].len, &stage));
    CHECK(stage.stage == 1 && stage.temporary == 1);

    OK(cxlkv_tier_finish_write(tier, keys, 2, codes));
    CHECK(codes[0] == CXLKV_TIER_SUCCESS && codes[1] == CXLKV_TIER_SUCCESS);
    CHECK(heard.calls[3] == 1 && heard.last_n[3] == 2);
    CHECK(heard.reentrant == CXLKV_STATUS_TIER_REENTRANT);
    CHECK(heard.lock_free == CXLKV_STATUS_OK);
    OK(cxlkv_tier_finish_write_and_reserve_read(tier, keys + 2, 1, 1, pages));
    CHECK(pages[0].code == CXLKV_TIER_SUCCESS && pages[0].data[0] == 'C');
    CHECK(heard.calls[4] == 1 && heard.calls[3] == 1); /* a promote never write_finished */

    CHECK(CXLKV_TIER_MAX_HOLDS == 128); /* the header declares the bound */
    /* Read: two holds on a retained key; unsafe_read shares the page. */
    OK(cxlkv_tier_reserve_read(tier, keys, 4, 2, pages));
    CHECK(pages[0].code == CXLKV_TIER_SUCCESS && pages[0].data[2999] == 'A');
    CHECK(pages[1].code == CXLKV_TIER_SUCCESS && pages[1].data[0] == 'B');
    CHECK(pages[3].code == CXLKV_TIER_KEY_NOT_EXIST && pages[3].data == NULL);
    cxlkv_tier_page again[1];
    OK(cxlkv_tier_unsafe_read(tier, keys, 1, again));
    CHECK(again[0].code == CXLKV_TIER_SUCCESS && again[0].data == pages[0].data);
    OK(cxlkv_tier_delete(tier, keys, 1, true /* ignored */, codes));
    CHECK(codes[0] == CXLKV_TIER_KEY_IS_LOCKED);
    OK(cxlkv_tier_finish_read(tier, keys, 1, 1, codes));
    OK(cxlkv_tier_delete(tier, keys, 1, false, codes));
    CHECK(codes[0] == CXLKV_TIER_KEY_IS_LOCKED); /* one hold left */
    OK(cxlkv_tier_finish_read(tier, keys, 2, 1, codes));
    OK(cxlkv_tier_finish_read(tier, keys, 1, 1, codes));
    OK(cxlkv_tier_finish_read(tier, keys, 1, 1, codes));
    CHECK(codes[0] == CXLKV_TIER_KEY_NOT_EXIST); /* nothing left to finish */

    OK(cxlkv_tier_touch_keys(tier, keys, 2));
    CHECK(heard.calls[6] == 1 && heard.last_n[6] == 2);

    /* Status, usage, stats, and the parity answers. */
    cxlkv_tier_status st = {0};
    st.size = sizeof st;
    OK(cxlkv_tier_report_status(tier, &st));
    CHECK(st.is_healthy == 1 && strcmp(st.backend, "cxlkv") == 0);
    /* Still held: retained-b (one hold) and the promoted temporary. */
    CHECK(st.read_locked_count == 2 && st.temporary_count == 1);
    uint64_t used = 0, total = 0;
    OK(cxlkv_tier_get_memory_usage(tier, &used, &total));
    CHECK(used >= 3 * PAGE_SIZE_BYTES && total >= used);
    EXPECT(cxlkv_tier_get_memory_usage(tier, NULL, &total), CXLKV_STATUS_INVALID_ARGUMENT);
    bool present = true;
    OK(cxlkv_tier_get_l1_memory_desc(tier, &present));
    CHECK(!present);
    present = true;
    OK(cxlkv_tier_get_object_state(tier, keys[0].data, keys[0].len, &present));
    CHECK(!present);
    bool healthy = false;
    OK(cxlkv_tier_memcheck(tier, &healthy));
    CHECK(healthy);
    cxlkv_tier_stats ts = {0};
    ts.size = sizeof ts;
    OK(cxlkv_tier_query_stats(tier, &ts));
    CHECK(ts.lookups >= 1 && ts.registers >= 1 && ts.unpin_round_trips >= 1);
    OK(cxlkv_tier_check_invariants(tier));
    uint64_t swept_writes = 9, swept_reads = 9;
    OK(cxlkv_tier_sweep_now(tier, &swept_writes, &swept_reads));
    CHECK(swept_writes == 0 && swept_reads == 0); /* nothing expired */

    /* Arguments refused as a whole. */
    cxlkv_bytes twice[2] = {keys[0], keys[0]};
    codes[0] = codes[1] = CXLKV_TIER_SUCCESS;
    EXPECT(cxlkv_tier_finish_read(tier, twice, 2, 1, codes), CXLKV_STATUS_TIER_DUPLICATE_KEY);
    /* A failed call's codes are unset, not a stale (or zeroed) SUCCESS. */
    CHECK(codes[0] == CXLKV_TIER_NOT_DONE && codes[1] == CXLKV_TIER_NOT_DONE);
    EXPECT(cxlkv_tier_reserve_read(tier, keys, 2, 1, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_tier_reserve_read(tier, NULL, 2, 1, pages), CXLKV_STATUS_INVALID_ARGUMENT);
    EXPECT(cxlkv_tier_finish_write(tier, keys, (size_t)1 << 40, codes), CXLKV_STATUS_BATCH_TOO_LARGE);
    EXPECT(cxlkv_tier_is_key_evictable(tier, keys[0].data, 0, &flag), CXLKV_STATUS_KEY_LENGTH);
    EXPECT(cxlkv_tier_inspect(tier, keys[0].data, keys[0].len, NULL), CXLKV_STATUS_INVALID_ARGUMENT);
    OK(cxlkv_tier_reserve_read(tier, NULL, 0, 1, NULL)); /* empty: a no-op */

    /* Bad handles. */
    cxlkv_tier *garbage = (cxlkv_tier *)(uintptr_t)0xC6000000000001ull;
    EXPECT(cxlkv_tier_clear(garbage, false), CXLKV_STATUS_BAD_HANDLE);
    EXPECT(cxlkv_tier_touch_keys((cxlkv_tier *)layout, keys, 1), CXLKV_STATUS_BAD_HANDLE);
    EXPECT(cxlkv_tier_memcheck(NULL, &healthy), CXLKV_STATUS_BAD_HANDLE);

    /* clear(force) drops both held stagings, with notification. */
    unsigned deleted_before = heard.calls[5];
    OK(cxlkv_tier_clear(tier, false));
    OK(cxlkv_tier_clear(tier, true));
    CHECK(heard.calls[5] == deleted_before + 1 && heard.last_n[5] == 2);
    CHECK(heard.events[CXLKV_TIER_EVENT_KEYS_EVICTED] >= 1);
    CHECK(heard.events[CXLKV_TIER_EVENT_WRITE_FINISHED] == 1);

    OK(cxlkv_tier_delete(tier, keys, 2, false, codes));
    CHECK(codes[0] == CXLKV_TIER_SUCCESS && codes[1] == CXLKV_TIER_SUCCESS);

    OK(cxlkv_tier_close(tier));
    EXPECT(cxlkv_tier_close(tier), CXLKV_STATUS_BAD_HANDLE);
    OK(cxlkv_tier_close(NULL));
    CHECK(heard.calls[0] >= 1 && heard.calls[1] >= 1 && heard.calls[2] >= 1);

    /* Expired reservations: the sweeper's pass, run now. */
    OK(cxlkv_tier_open(layout, NULL, &tier));
    cxlkv_tier_config fast;
    OK(cxlkv_tier_config_init(&fast, sizeof fast));
    fast.write_ttl_ms = 1;
    cxlkv_tier *short_lived = NULL;
    OK(cxlkv_tier_open(layout, &fast, &short_lived));
    uint8_t not_temporary = 0;
    OK(cxlkv_tier_reserve_write(short_lived, keys + 3, &not_temporary, 1, 10,
                                CXLKV_TIER_WRITE_NEW, pages));
    CHECK(pages[0].code == CXLKV_TIER_SUCCESS);
    struct timespec pause = {0, 20 * 1000 * 1000};
    nanosleep(&pause, NULL);
    OK(cxlkv_tier_sweep_now(short_lived, &swept_writes, &swept_reads));
    CHECK(swept_writes == 1);
    OK(cxlkv_tier_finish_write(short_lived, keys + 3, 1, codes));
    CHECK(codes[0] == CXLKV_TIER_KEY_NOT_EXIST); /* reclaimed */
    OK(cxlkv_tier_close(short_lived));

    /* Mapping holds: a page returned by a holding tier stays mapped until
     * released, also after the sweeper reclaimed its reservation and the
     * tier was closed; each page returned is released once. */
    fast.flags = 0x80000000u;
    EXPECT(cxlkv_tier_open(layout, &fast, &short_lived), CXLKV_STATUS_INVALID_ARGUMENT);
    fast.flags = CXLKV_TIER_HOLD_MAPPINGS;
    OK(cxlkv_tier_open(layout, &fast, &short_lived));
    OK(cxlkv_tier_reserve_write(short_lived, keys + 3, &not_temporary, 1, 10,
                                CXLKV_TIER_WRITE_NEW, pages));
    CHECK(pages[0].code == CXLKV_TIER_SUCCESS);
    memset(pages[0].data, 0x5A, 10);
    nanosleep(&pause, NULL);
    OK(cxlkv_tier_sweep_now(short_lived, &swept_writes, &swept_reads));
    CHECK(swept_writes == 1);
    OK(cxlkv_tier_close(short_lived));
    CHECK(pages[0].data[0] == 0x5A); /* still mapped: held */
    OK(cxlkv_tier_release_page(pages[0].data));
    EXPECT(cxlkv_tier_release_page(pages[0].data), CXLKV_STATUS_BAD_HANDLE);
    OK(cxlkv_tier_release_page(NULL));
    OK(cxlkv_tier_close(tier));
}

/* Several threads share one client and one layout. */
enum { THREADS = 4, ROUNDS = 25 };
static cxlkv_layout *shared_layout;

static void *worker(void *arg) {
    int t = (int)(intptr_t)arg;
    for (int round = 0; round < ROUNDS; round++) {
        char name[64];
        snprintf(name, sizeof name, "api-test/thread-%d-%d", t, round);
        cxlkv_bytes k = key_of(name);
        uint8_t chunk[512];
        memset(chunk, t * 16 + round, sizeof chunk);
        cxlkv_register_result r;
        OK(cxlkv_put(shared_layout, k.data, k.len, chunk, sizeof chunk, &r));
        CHECK(r.outcome == CXLKV_REGISTER_INSERTED);
        cxlkv_view v;
        OK(cxlkv_get(shared_layout, k.data, k.len, &v));
        CHECK(v.guard != NULL && memcmp(v.data, chunk, sizeof chunk) == 0);
        OK(cxlkv_release(&v));
        cxlkv_delete_result d;
        OK(cxlkv_delete(shared_layout, k.data, k.len, &d));
        CHECK(d.outcome == CXLKV_DELETE_DELETED);
    }
    return NULL;
}

static void test_threads_share_a_layout(cxlkv_layout *layout) {
    shared_layout = layout;
    pthread_t threads[THREADS];
    for (int t = 0; t < THREADS; t++) {
        CHECK(pthread_create(&threads[t], NULL, worker, (void *)(intptr_t)t) == 0);
    }
    for (int t = 0; t < THREADS; t++) {
        CHECK(pthread_join(threads[t], NULL) == 0);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    socket_path = argv[1];

    test_version_status_and_last_error();
    test_last_error_is_per_thread();
    test_config_sizes_and_fields();

    cxlkv_config c = config_for_tests();
    cxlkv_client *client = NULL;
    cxlkv_layout *layout = NULL;
    OK(cxlkv_connect(&c, &client));
    OK(cxlkv_layout_open(client, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &layout));
    if (client == NULL || layout == NULL) {
        fprintf(stderr, "api_test: cannot connect to %s\n", socket_path);
        return 1;
    }
    test_bad_handles(client, layout);
    test_null_and_length_arguments(layout);
    test_put_get_exists_delete(layout);
    test_leases(layout);
    test_layouts(client);
    test_threads_share_a_layout(layout);
    test_tier(layout);
    OK(cxlkv_layout_close(layout));
    OK(cxlkv_close(client));

    test_stats_and_observers();
    test_closed_client();
    test_handles_do_not_cross_fork();

    if (failures != 0) {
        fprintf(stderr, "api_test: %d check(s) failed\n", failures);
        return 1;
    }
    printf("api_test: all checks passed\n");
    return 0;
}
