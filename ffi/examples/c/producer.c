/*
 * producer: writes chunks into the shared pool through a running cxlkv
 * server, then exits. The chunks stay readable by every process (the
 * consumer reads them in place), even after this process is gone.
 *
 *   usage: producer SOCKET [COUNT]
 *
 * Half of the chunks are written in place (allocate pages, fill them where
 * they lie in the pool, register them in one round trip); the other half
 * are copied in by cxlkv_batch_put.
 */
#include <cxlkv.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PAGE_SIZE_BYTES (64u * 1024u)
#define FINGERPRINT 0x6578616d706c65ull /* "example": the model's layout */
#define MAX_COUNT 256u
#define KEY_CAP 64u

/* Reports a failed call with the library's message; 0 on success. */
static int failed(cxlkv_status status, const char *what) {
    if (status == CXLKV_STATUS_OK) {
        return 0;
    }
    fprintf(stderr, "producer: %s: %s: %s\n", what, cxlkv_status_name(status),
            cxlkv_last_error());
    return 1;
}

/* Chunk i: its length and bytes, which the consumer recomputes. */
static size_t chunk_len(unsigned i) { return 4096u * (i % 4u + 1u) + i; }
static void chunk_fill(uint8_t *dst, unsigned i) {
    for (size_t j = 0; j < chunk_len(i); j++) {
        dst[j] = (uint8_t)(i * 31u + j * 7u);
    }
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET [COUNT]\n", argv[0]);
        return 2;
    }
    unsigned count = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 10) : 16u;
    if (count == 0 || count > MAX_COUNT) {
        fprintf(stderr, "producer: COUNT must be 1..%u\n", MAX_COUNT);
        return 2;
    }
    unsigned in_place = count / 2u;
    unsigned copied = count - in_place;

    cxlkv_config config;
    if (failed(cxlkv_config_init(&config, sizeof config), "config")) {
        return 1;
    }
    config.socket_path = argv[1];
    config.region_size_bytes = 4u << 20;

    cxlkv_client *client = NULL;
    cxlkv_layout *layout = NULL;
    int rc = 1;
    if (failed(cxlkv_connect(&config, &client), "connect") ||
        failed(cxlkv_layout_open(client, PAGE_SIZE_BYTES, FINGERPRINT, NULL, &layout),
               "layout")) {
        goto out;
    }

    static char names[MAX_COUNT][KEY_CAP];
    static cxlkv_bytes keys[MAX_COUNT];
    static cxlkv_register_result results[MAX_COUNT];
    for (unsigned i = 0; i < count; i++) {
        int n = snprintf(names[i], KEY_CAP, "example/chunk/%u", i);
        keys[i].data = (const uint8_t *)names[i];
        keys[i].len = (size_t)n;
    }

    /* 1. In place: lease pages, write them where they lie, register. */
    static cxlkv_lease *leases[MAX_COUNT];
    if (failed(cxlkv_batch_alloc(layout, in_place, leases), "alloc")) {
        goto out;
    }
    for (unsigned i = 0; i < in_place; i++) {
        uint8_t *page = NULL;
        uint64_t capacity = 0;
        if (failed(cxlkv_lease_data(leases[i], &page, &capacity), "lease data") ||
            failed(cxlkv_lease_set_len(leases[i], chunk_len(i)), "lease length")) {
            /* Registration below consumes every lease, failed or not. */
            break;
        }
        chunk_fill(page, i);
    }
    if (failed(cxlkv_batch_register(layout, keys, leases, in_place, results), "register")) {
        goto out;
    }

    /* 2. Copied in: cxlkv_batch_put allocates, copies and registers. */
    static uint8_t buffers[MAX_COUNT][PAGE_SIZE_BYTES];
    static cxlkv_bytes values[MAX_COUNT];
    for (unsigned i = in_place; i < count; i++) {
        chunk_fill(buffers[i], i);
        values[i].data = buffers[i];
        values[i].len = chunk_len(i);
    }
    if (failed(cxlkv_batch_put(layout, keys + in_place, values + in_place, copied,
                               results + in_place),
               "put")) {
        goto out;
    }

    unsigned inserted = 0, duplicates = 0;
    for (unsigned i = 0; i < count; i++) {
        if (results[i].outcome == CXLKV_REGISTER_INSERTED) {
            inserted++;
        } else if (results[i].outcome == CXLKV_REGISTER_DUPLICATE) {
            duplicates++; /* an earlier run's chunk is still there */
        } else {
            fprintf(stderr, "producer: %s rejected (reason %u)\n", names[i],
                    (unsigned)results[i].reject_reason);
            goto out;
        }
    }
    printf("producer: %u chunks (%u in place, %u copied): %u inserted, %u already there\n",
           count, in_place, copied, inserted, duplicates);
    rc = 0;

out:
    cxlkv_layout_close(layout);
    if (failed(cxlkv_close(client), "close")) {
        rc = 1;
    }
    return rc;
}
