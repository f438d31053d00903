/*
 * tier: the L1 tier as an engine's tiering controller drives it — store
 * (write, then write-through to L2 on `write_finished`), promote from L2
 * into a private temporary, read with one hold per tensor-parallel worker,
 * evict through the listener's `deleted`.
 *
 *   usage: tier SOCKET
 */
#include <cxlkv.h>

#include <stdio.h>
#include <string.h>

#define PAGE_SIZE_BYTES (64u * 1024u)
#define FINGERPRINT 0x746965720000ull /* "tier" */
#define CHUNK_BYTES 4096u
#define TP_WORKERS 2u

static int failed(cxlkv_status status, const char *what) {
    if (status == CXLKV_STATUS_OK) {
        return 0;
    }
    fprintf(stderr, "tier: %s: %s: %s\n", what, cxlkv_status_name(status), cxlkv_last_error());
    return 1;
}

/* The engine's controllers, reduced to counters: the store controller
 * copies keys to L2 on write_finished; the eviction policy forgets keys on
 * deleted. Listeners run under the tier's lock: no calls back into it. */
struct controllers {
    unsigned written_through;
    unsigned evicted;
};

static void on_write_finished(void *user_data, const cxlkv_bytes *keys, size_t n) {
    struct controllers *c = user_data;
    for (size_t i = 0; i < n; i++) {
        printf("tier: write-through to L2: %.*s\n", (int)keys[i].len, (const char *)keys[i].data);
    }
    c->written_through += (unsigned)n;
}

static void on_deleted(void *user_data, const cxlkv_bytes *keys, size_t n) {
    (void)keys;
    ((struct controllers *)user_data)->evicted += (unsigned)n;
}

static int all_succeeded(const cxlkv_tier_page *pages, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (pages[i].code != CXLKV_TIER_SUCCESS) {
            return 0;
        }
    }
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    cxlkv_config config;
    if (failed(cxlkv_config_init(&config, sizeof config), "config")) {
        return 1;
    }
    config.socket_path = argv[1];
    config.region_size_bytes = 4u << 20;

    cxlkv_client *client = NULL;
    cxlkv_layout *layout = NULL;
    cxlkv_tier *tier = NULL;
    int rc = 1;
    if (failed(cxlkv_connect(&config, &client), "connect") ||
        failed(cxlkv_layout_open(client, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &layout), "layout") ||
        failed(cxlkv_tier_open(layout, NULL, &tier), "tier")) {
        goto out;
    }
    struct controllers controllers = {0, 0};
    cxlkv_tier_listener listener;
    memset(&listener, 0, sizeof listener);
    listener.size = sizeof listener;
    listener.write_finished = on_write_finished;
    listener.deleted = on_deleted;
    listener.user_data = &controllers;
    if (failed(cxlkv_tier_register_listener(tier, &listener), "listener")) {
        goto out;
    }

    /* Store: reserve pages, fill them in place, finish (registers them). */
    cxlkv_bytes stored[3] = {{(const uint8_t *)"chunk-a", 7},
                             {(const uint8_t *)"chunk-b", 7},
                             {(const uint8_t *)"chunk-c", 7}};
    uint8_t retained[3] = {0, 0, 0};
    cxlkv_tier_page pages[3];
    cxlkv_tier_code codes[3];
    if (failed(cxlkv_tier_reserve_write(tier, stored, retained, 3, CHUNK_BYTES,
                                        CXLKV_TIER_WRITE_NEW, pages),
               "reserve_write") ||
        !all_succeeded(pages, 3)) {
        goto out;
    }
    for (int i = 0; i < 3; i++) {
        memset(pages[i].data, 'a' + i, pages[i].len_bytes); /* the KV bytes */
    }
    if (failed(cxlkv_tier_finish_write(tier, stored, 3, codes), "finish_write")) {
        goto out;
    }

    /* Promote: an L2 hit loaded into a private temporary page, held for
     * reading; the last finish_read reclaims it. */
    cxlkv_bytes promoted[1] = {{(const uint8_t *)"chunk-from-l2", 13}};
    uint8_t temporary[1] = {1};
    if (failed(cxlkv_tier_reserve_write(tier, promoted, temporary, 1, CHUNK_BYTES,
                                        CXLKV_TIER_WRITE_NEW, pages),
               "reserve_write (promote)") ||
        !all_succeeded(pages, 1)) {
        goto out;
    }
    memset(pages[0].data, 'L', CHUNK_BYTES); /* loaded from L2 */
    if (failed(cxlkv_tier_finish_write_and_reserve_read(tier, promoted, 1, 1, pages),
               "promote") ||
        !all_succeeded(pages, 1) || pages[0].data[0] != 'L' ||
        failed(cxlkv_tier_finish_read(tier, promoted, 1, 1, codes), "finish_read (promote)")) {
        goto out;
    }

    /* Read: one hold per tensor-parallel worker; each worker finishes one. */
    if (failed(cxlkv_tier_reserve_read(tier, stored, 3, TP_WORKERS, pages), "reserve_read") ||
        !all_succeeded(pages, 3)) {
        goto out;
    }
    int intact = pages[0].data[0] == 'a' && pages[2].data[CHUNK_BYTES - 1] == 'c';
    for (unsigned w = 0; w < TP_WORKERS; w++) {
        if (failed(cxlkv_tier_finish_read(tier, stored, 3, 1, codes), "finish_read")) {
            goto out;
        }
    }

    /* Evict: the policy deletes when usage passes its watermark. */
    uint64_t used = 0, total = 0;
    if (failed(cxlkv_tier_get_memory_usage(tier, &used, &total), "memory usage") ||
        failed(cxlkv_tier_delete(tier, stored, 3, false, codes), "delete")) {
        goto out;
    }
    cxlkv_tier_status status;
    memset(&status, 0, sizeof status);
    status.size = sizeof status;
    if (failed(cxlkv_tier_report_status(tier, &status), "status")) {
        goto out;
    }
    printf("tier: backend %s, %llu of %llu bytes used before eviction, %u written through, "
           "%u evicted (promote included), %llu objects staged, bytes %s\n",
           status.backend, (unsigned long long)used, (unsigned long long)total,
           controllers.written_through, controllers.evicted,
           (unsigned long long)status.total_object_count, intact ? "intact" : "CORRUPT");
    rc = intact && controllers.written_through == 3 && controllers.evicted == 4 &&
                 status.total_object_count == 0
             ? 0
             : 1;

out:
    if (failed(cxlkv_tier_close(tier), "tier close")) {
        rc = 1;
    }
    cxlkv_layout_close(layout);
    cxlkv_close(client);
    return rc;
}
