/*
 * consumer: reads the producer's chunks in place — the bytes are the
 * pool's, mapped into this process; nothing is copied — checks them,
 * releases them and deletes the keys.
 *
 *   usage: consumer SOCKET [COUNT]
 *
 * Waits (up to 30 s) for the producer's keys to appear, so the two may be
 * started in either order.
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep */

#include <cxlkv.h>

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define PAGE_SIZE_BYTES (64u * 1024u)
#define FINGERPRINT 0x6578616d706c65ull
#define MAX_COUNT 256u
#define KEY_CAP 64u
#define WAIT_SECONDS 30

static int failed(cxlkv_status status, const char *what) {
    if (status == CXLKV_STATUS_OK) {
        return 0;
    }
    fprintf(stderr, "consumer: %s: %s: %s\n", what, cxlkv_status_name(status),
            cxlkv_last_error());
    return 1;
}

static size_t chunk_len(unsigned i) { return 4096u * (i % 4u + 1u) + i; }
static uint8_t chunk_byte(unsigned i, size_t j) { return (uint8_t)(i * 31u + j * 7u); }

/* Region map callback: an engine would register the range with its GPU
 * here (cudaHostRegister; with cudaHostRegisterReadOnly when
 * info->read_only, as for every peer's region); this one counts. It may
 * run on several threads at once: the count is atomic. */
static void on_map(void *user_data, const cxlkv_map_info *info) {
    atomic_fetch_add((atomic_uint *)user_data, 1u);
    printf("consumer: mapped region %llu (%llu bytes%s)\n", (unsigned long long)info->region_id,
           (unsigned long long)info->len_bytes, info->read_only ? ", read-only" : "");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET [COUNT]\n", argv[0]);
        return 2;
    }
    unsigned count = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 10) : 16u;
    if (count == 0 || count > MAX_COUNT) {
        fprintf(stderr, "consumer: COUNT must be 1..%u\n", MAX_COUNT);
        return 2;
    }

    atomic_uint mapped = 0;
    cxlkv_config config;
    if (failed(cxlkv_config_init(&config, sizeof config), "config")) {
        return 1;
    }
    config.socket_path = argv[1];
    config.map_callbacks.on_map = on_map;
    config.map_callbacks.user_data = &mapped;

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
    for (unsigned i = 0; i < count; i++) {
        int n = snprintf(names[i], KEY_CAP, "example/chunk/%u", i);
        keys[i].data = (const uint8_t *)names[i];
        keys[i].len = (size_t)n;
    }

    /* Wait for the producer: one existence check per round trip. */
    static bool present[MAX_COUNT];
    time_t deadline = time(NULL) + WAIT_SECONDS;
    for (;;) {
        if (failed(cxlkv_batch_exists(layout, keys, count, present), "exists")) {
            goto out;
        }
        unsigned found = 0;
        for (unsigned i = 0; i < count; i++) {
            found += present[i];
        }
        if (found == count) {
            break;
        }
        if (time(NULL) > deadline) {
            fprintf(stderr, "consumer: only %u of %u keys after %d s\n", found, count,
                    WAIT_SECONDS);
            goto out;
        }
        struct timespec pause = {0, 10 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }

    /* Read in place: one round trip pins every key; each view points into
     * this process's mapping of the producer's region. */
    static cxlkv_view views[MAX_COUNT];
    if (failed(cxlkv_batch_get(layout, keys, count, views), "get")) {
        goto out;
    }
    unsigned good = 0;
    unsigned long long bytes = 0;
    for (unsigned i = 0; i < count; i++) {
        const cxlkv_view *v = &views[i];
        int ok = v->guard != NULL && v->len_bytes == chunk_len(i);
        for (size_t j = 0; ok && j < v->len_bytes; j++) {
            ok = v->data[j] == chunk_byte(i, j);
        }
        good += (unsigned)ok;
        bytes += v->len_bytes;
    }
    if (failed(cxlkv_batch_release(views, count), "release")) {
        goto out;
    }

    /* The views are released, so nothing pins the keys any more. */
    static cxlkv_delete_result deleted[MAX_COUNT];
    if (failed(cxlkv_batch_delete(layout, keys, count, deleted), "delete")) {
        goto out;
    }
    unsigned gone = 0;
    for (unsigned i = 0; i < count; i++) {
        gone += deleted[i].outcome == CXLKV_DELETE_DELETED;
    }

    printf("consumer: %u of %u chunks intact (%llu bytes read in place, %u regions mapped), "
           "%u deleted\n",
           good, count, bytes, atomic_load(&mapped), gone);
    rc = (good == count && gone == count) ? 0 : 1;

out:
    cxlkv_layout_close(layout);
    if (failed(cxlkv_close(client), "close")) {
        rc = 1;
    }
    return rc;
}
