/*
 * C ABI test of libdmlc_guest (run by tests/c_abi.rs, one process per rank).
 *
 *   allreduce SOCKET [interrupt]   every collective through the C API, checked;
 *                                  prints "PASS rank R of N" and exits 0
 *   allreduce --constants          prints "NAME VALUE" for every constant of
 *                                  the header, for the Rust side to compare
 *                                  with the device ABI
 */
#include "dmlc_guest.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, " (last error: %s)\n", dmlc_last_error_message()); \
            failures++;                                                         \
        }                                                                       \
    } while (0)

/* Calls a dmlc function that must succeed; on failure exits (later checks
 * would only cascade). */
#define MUST(call)                                                              \
    do {                                                                        \
        int rc_ = (call);                                                       \
        if (rc_ != DMLC_OK) {                                                   \
            fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call, \
                    dmlc_strerror(rc_), dmlc_last_error_message());             \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

#define PRINT(name) printf("%s %lld\n", #name, (long long)(name))
/* "offsetof(S, F) N" and "sizeof(S.F) N" for one field. */
#define FIELD(s, f)                                                             \
    do {                                                                        \
        PRINT(offsetof(s, f));                                                  \
        printf("sizeof(%s.%s) %zu\n", #s, #f, sizeof(((s *)0)->f));            \
    } while (0)

static int constants(void)
{
    PRINT(DMLC_OK);
    PRINT(DMLC_ERR_BAD_REQUEST);
    PRINT(DMLC_ERR_MISMATCH);
    PRINT(DMLC_ERR_PEER_LOST);
    PRINT(DMLC_ERR_TIMEOUT);
    PRINT(DMLC_ERR_UNSUPPORTED);
    PRINT(DMLC_ERR_TOO_BIG);
    PRINT(DMLC_ERR_RESET);
    PRINT(DMLC_ERR_TRUNCATE);
    PRINT(DMLC_ERR_NONFINITE);
    PRINT(DMLC_ERR_INVALID_ARGUMENT);
    PRINT(DMLC_ERR_NO_STATUS);
    PRINT(DMLC_ERR_UNKNOWN_STATUS);
    PRINT(DMLC_ERR_WAIT_TIMEOUT);
    PRINT(DMLC_ERR_QUEUE_FULL);
    PRINT(DMLC_ERR_OUT_OF_MEMORY);
    PRINT(DMLC_ERR_UNKNOWN_HANDLE);
    PRINT(DMLC_ERR_TRANSPORT);
    PRINT(DMLC_ERR_DEVICE);
    PRINT(DMLC_ERR_INTERNAL);
    PRINT(DMLC_ERR_UNANSWERED);
    PRINT(DMLC_ERR_REQUEST_DROPPED);
    PRINT(DMLC_ERR_BUFFER_BUSY);
    PRINT(DMLC_ERR_ENVIRONMENT);
    PRINT(DMLC_ABI_VERSION);
    PRINT(dmlc_abi_version());
    PRINT(DMLC_DTYPE_F32);
    PRINT(DMLC_DTYPE_F64);
    PRINT(DMLC_DTYPE_F16);
    PRINT(DMLC_DTYPE_BF16);
    PRINT(DMLC_DTYPE_I8);
    PRINT(DMLC_DTYPE_U8);
    PRINT(DMLC_DTYPE_I32);
    PRINT(DMLC_DTYPE_U32);
    PRINT(DMLC_DTYPE_I64);
    PRINT(DMLC_DTYPE_U64);
    PRINT(DMLC_OP_SUM);
    PRINT(DMLC_OP_PROD);
    PRINT(DMLC_OP_MIN);
    PRINT(DMLC_OP_MAX);
    PRINT(DMLC_OP_AVG);
    PRINT(DMLC_OP_BAND);
    PRINT(DMLC_OP_BOR);
    PRINT(DMLC_OP_BXOR);
    PRINT(DMLC_OPCODE_ALLREDUCE);
    PRINT(DMLC_OPCODE_BROADCAST);
    PRINT(DMLC_OPCODE_REDUCE);
    PRINT(DMLC_OPCODE_ALLGATHER);
    PRINT(DMLC_OPCODE_REDUCE_SCATTER);
    PRINT(DMLC_OPCODE_BARRIER);
    PRINT(DMLC_OPCODE_NOP);
    PRINT(DMLC_OPCODE_SEND);
    PRINT(DMLC_OPCODE_RECV);
    PRINT(DMLC_OPCODE_ALLTOALL);
    PRINT(DMLC_OPCODE_ALLTOALLV);
    PRINT(DMLC_OPCODE_GATHER);
    PRINT(DMLC_OPCODE_GATHERV);
    PRINT(DMLC_OPCODE_SCATTER);
    PRINT(DMLC_OPCODE_SCATTERV);
    PRINT(DMLC_OPCODE_COMM_SPLIT);
    PRINT(DMLC_OPCODE_COMM_CREATE);
    PRINT(DMLC_OPCODE_COMM_FREE);
    PRINT(DMLC_FLAG_IN_PLACE);
    PRINT(DMLC_NO_PEER);
    PRINT(DMLC_COMM_WORLD);
    PRINT(DMLC_ANY_SOURCE);
    PRINT(DMLC_UNDEFINED);
    PRINT(DMLC_FEATURE_COMM);
    PRINT(DMLC_FEATURE_P2P);
    PRINT(DMLC_FEATURE_BLOCKS);
    PRINT(DMLC_BAD_COMM);
    PRINT(DMLC_BAD_PEER);
    PRINT(DMLC_BAD_TABLE);
    PRINT(DMLC_BAD_IN_PLACE_OPCODE);
    PRINT(DMLC_MISMATCH_TABLE);
    PRINT(DMLC_TOO_BIG_COMMS);
    PRINT(DMLC_WAIT_INTERRUPT);
    PRINT(DMLC_WAIT_POLL);
    PRINT(DMLC_WAIT_HYBRID);
    PRINT(sizeof(dmlc_config));
    PRINT(sizeof(dmlc_request));
    PRINT(sizeof(dmlc_open_options));
    PRINT(sizeof(dmlc_segment));
    PRINT(sizeof(dmlc_completion));
    PRINT(sizeof(dmlc_comm_info));
    PRINT(sizeof(dmlc_comm_request));
    PRINT(sizeof(dmlc_comm_completion));
    FIELD(dmlc_config, rank);
    FIELD(dmlc_config, world_size);
    FIELD(dmlc_config, num_queues);
    FIELD(dmlc_config, max_segments);
    FIELD(dmlc_config, max_bytes);
    FIELD(dmlc_config, dtypes);
    FIELD(dmlc_config, ops);
    FIELD(dmlc_config, opcodes);
    FIELD(dmlc_config, generation);
    FIELD(dmlc_config, group_id);
    FIELD(dmlc_open_options, poll);
    FIELD(dmlc_open_options, queue_size);
    FIELD(dmlc_open_options, event_idx);
    FIELD(dmlc_open_options, dma_bytes);
    FIELD(dmlc_request, opcode);
    FIELD(dmlc_request, dtype);
    FIELD(dmlc_request, op);
    FIELD(dmlc_request, root);
    FIELD(dmlc_request, count);
    FIELD(dmlc_request, tag);
    FIELD(dmlc_request, flags);
    FIELD(dmlc_request, timeout_ms);
    FIELD(dmlc_segment, buf);
    FIELD(dmlc_segment, offset);
    FIELD(dmlc_segment, len);
    FIELD(dmlc_completion, status);
    FIELD(dmlc_completion, detail);
    FIELD(dmlc_completion, peer);
    FIELD(dmlc_completion, generation);
    FIELD(dmlc_comm_info, id);
    FIELD(dmlc_comm_info, rank);
    FIELD(dmlc_comm_info, size);
    FIELD(dmlc_comm_request, opcode);
    FIELD(dmlc_comm_request, dtype);
    FIELD(dmlc_comm_request, op);
    FIELD(dmlc_comm_request, root);
    FIELD(dmlc_comm_request, count);
    FIELD(dmlc_comm_request, tag);
    FIELD(dmlc_comm_request, flags);
    FIELD(dmlc_comm_request, timeout_ms);
    FIELD(dmlc_comm_request, comm);
    FIELD(dmlc_comm_request, peer);
    FIELD(dmlc_comm_request, key);
    FIELD(dmlc_comm_request, table_bytes);
    FIELD(dmlc_comm_request, table);
    FIELD(dmlc_comm_completion, status);
    FIELD(dmlc_comm_completion, detail);
    FIELD(dmlc_comm_completion, peer);
    FIELD(dmlc_comm_completion, generation);
    FIELD(dmlc_comm_completion, length);
    FIELD(dmlc_comm_completion, comm);
    FIELD(dmlc_comm_completion, comm_rank);
    FIELD(dmlc_comm_completion, comm_size);
    FIELD(dmlc_comm_completion, peer_world);
    for (int d = 0; d <= 9; d++)
        printf("dmlc_dtype_size(%d) %zu\n", d, dmlc_dtype_size(d));
    return 0;
}

/* The API must refuse misuse with a status, never crash. */
static void misuse(dmlc_device *dev, dmlc_buffer *small)
{
    dmlc_device *none = NULL;
    CHECK(dmlc_open_host(NULL, 1, &none) == DMLC_ERR_INVALID_ARGUMENT, "open NULL socket");
    CHECK(strlen(dmlc_last_error_message()) > 0, "no message after an error");
    CHECK(dmlc_open_host("/nonexistent/dmlc.sock", 1, &none) == DMLC_ERR_TRANSPORT,
          "open of a missing socket");
    CHECK(none == NULL, "out set on failure");
    CHECK(dmlc_open_host("/tmp/x", 1, NULL) == DMLC_ERR_INVALID_ARGUMENT, "open NULL out");
    CHECK(dmlc_rank(NULL) == -1, "rank(NULL)");
    CHECK(dmlc_world_size(NULL) == -1, "world_size(NULL)");
    CHECK(dmlc_get_config(dev, NULL) == DMLC_ERR_INVALID_ARGUMENT, "config NULL out");
    CHECK(dmlc_allreduce(NULL, small, small, 1, DMLC_DTYPE_F32, DMLC_OP_SUM) ==
              DMLC_ERR_INVALID_ARGUMENT, "allreduce NULL dev");
    CHECK(dmlc_allreduce(dev, small, NULL, 1, DMLC_DTYPE_F32, DMLC_OP_SUM) ==
              DMLC_ERR_INVALID_ARGUMENT, "allreduce NULL recv");
    CHECK(dmlc_barrier(NULL) == DMLC_ERR_INVALID_ARGUMENT, "barrier NULL");
    CHECK(dmlc_alloc(dev, 0, NULL) == DMLC_ERR_INVALID_ARGUMENT, "alloc NULL out");
    CHECK(dmlc_buffer_data(NULL) == NULL && dmlc_buffer_size(NULL) == 0, "buffer NULL");
    {
        /* Only the kernel transport reaches the caller's own memory. */
        float mine[4] = { 0 };
        dmlc_buffer *wrapped = small;

        CHECK(dmlc_wrap_memory(dev, mine, sizeof(mine), &wrapped) ==
                  DMLC_ERR_INVALID_ARGUMENT && wrapped == NULL,
              "wrap over the host transport");
        CHECK(strstr(dmlc_last_error_message(), "kernel transport") != NULL,
              "message names the kernel transport: %s", dmlc_last_error_message());
        CHECK(dmlc_wrap_memory(dev, mine, sizeof(mine), NULL) == DMLC_ERR_INVALID_ARGUMENT,
              "wrap NULL out");
    }
    CHECK(dmlc_wait(dev, NULL, 0, NULL) == DMLC_ERR_INVALID_ARGUMENT, "wait NULL handle");
    CHECK(dmlc_submit(dev, 0, NULL, NULL, 0, NULL, 0, NULL) == DMLC_ERR_INVALID_ARGUMENT,
          "submit NULL");
    CHECK(dmlc_allreduce_host(dev, NULL, NULL, 4, DMLC_DTYPE_F32, DMLC_OP_SUM) ==
              DMLC_ERR_INVALID_ARGUMENT, "allreduce_host NULL");
    /* Local errors: no request reaches the device, so no sequence number is
     * taken and the members stay in step. */
    size_t cap = dmlc_buffer_size(small) / 4;
    CHECK(dmlc_allreduce(dev, small, small, cap + 1, DMLC_DTYPE_F32, DMLC_OP_SUM) ==
              DMLC_ERR_INVALID_ARGUMENT, "count beyond the buffer");
    CHECK(strstr(dmlc_last_error_message(), "buffer") != NULL, "message names the buffer: %s",
          dmlc_last_error_message());
    CHECK(dmlc_allreduce(dev, small, small, 1, 42, DMLC_OP_SUM) == DMLC_ERR_UNSUPPORTED,
          "unknown dtype");
    CHECK(dmlc_allreduce(dev, small, small, 1, DMLC_DTYPE_F32, 42) == DMLC_ERR_UNSUPPORTED,
          "unknown op");
    CHECK(dmlc_broadcast(dev, small, small, 1, DMLC_DTYPE_F32, 1000) == DMLC_ERR_BAD_REQUEST,
          "root out of range");
    dmlc_request bad = {DMLC_OPCODE_ALLREDUCE, DMLC_DTYPE_F32, DMLC_OP_SUM, 0, 1, 0, 0, 0};
    dmlc_segment seg = {small, 0, 4};
    dmlc_handle *h = NULL;
    CHECK(dmlc_submit(dev, 999, &bad, &seg, 1, &seg, 1, &h) == DMLC_ERR_INVALID_ARGUMENT,
          "bad queue");
    seg.offset = dmlc_buffer_size(small);
    CHECK(dmlc_submit(dev, 0, &bad, &seg, 1, &seg, 1, &h) == DMLC_ERR_INVALID_ARGUMENT,
          "segment outside the buffer");
    for (int s = 0; s < 120; s++)
        CHECK(dmlc_strerror(s) != NULL, "strerror(%d)", s);
    CHECK(strcmp(dmlc_strerror(DMLC_ERR_PEER_LOST), dmlc_strerror(DMLC_ERR_MISMATCH)) != 0,
          "distinct texts");
    CHECK(dmlc_dtype_size(DMLC_DTYPE_BF16) == 2 && dmlc_dtype_size(77) == 0, "dtype_size");
    dmlc_close(NULL);
    dmlc_free(NULL);
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--constants") == 0)
        return constants();
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET [interrupt] | --constants\n", argv[0]);
        return 2;
    }
    int poll = !(argc > 2 && strcmp(argv[2], "interrupt") == 0);

    dmlc_open_options opts;
    dmlc_open_options_init(&opts);
    CHECK(opts.poll == DMLC_WAIT_HYBRID && opts.queue_size > 0 && opts.dma_bytes > 0, "defaults");
    opts.poll = poll;
    opts.dma_bytes = 64u << 20;
    dmlc_device *dev = NULL;
    MUST(dmlc_open_host_ex(argv[1], &opts, &dev));
    int32_t rank = dmlc_rank(dev), n = dmlc_world_size(dev);
    CHECK(rank >= 0 && n >= 1 && rank < n, "rank %d world %d", rank, n);
    dmlc_config cfg;
    MUST(dmlc_get_config(dev, &cfg));
    CHECK(cfg.rank == (uint32_t)rank && cfg.world_size == (uint32_t)n, "config");
    CHECK(cfg.generation >= 1 && cfg.max_bytes > 0, "config generation %u", cfg.generation);
    CHECK(dmlc_num_queues(dev) == (int32_t)cfg.num_queues, "queues");
    CHECK(dmlc_wait_mode(dev) == poll, "wait mode %d, asked for %d", dmlc_wait_mode(dev), poll);
    CHECK(dmlc_wait_mode(NULL) == -1, "wait mode of NULL");

    enum { COUNT = 1000 };
    dmlc_buffer *send = NULL, *recv = NULL, *small = NULL;
    MUST(dmlc_alloc(dev, COUNT * sizeof(double) * 4, &send));
    MUST(dmlc_alloc(dev, COUNT * sizeof(double) * 4, &recv));
    MUST(dmlc_alloc(dev, 16, &small));
    CHECK(dmlc_buffer_size(send) >= COUNT * sizeof(double) * 4, "size");
    misuse(dev, small);

    /* allreduce f32 sum, out of place. */
    float *fs = dmlc_buffer_data(send), *fr = dmlc_buffer_data(recv);
    for (int i = 0; i < COUNT; i++)
        fs[i] = (float)(rank + 1 + i);
    MUST(dmlc_allreduce(dev, send, recv, COUNT, DMLC_DTYPE_F32, DMLC_OP_SUM));
    for (int i = 0; i < COUNT; i++) {
        float want = (float)(n * (n + 1) / 2 + n * i);
        if (fr[i] != want) {
            CHECK(0, "allreduce[%d] = %g, want %g", i, fr[i], want);
            break;
        }
    }

    /* allreduce i32 max, in place (send NULL). */
    int32_t *ir = dmlc_buffer_data(recv);
    for (int i = 0; i < COUNT; i++)
        ir[i] = (i % 2 ? rank : -rank) * 10 + i;
    MUST(dmlc_allreduce(dev, NULL, recv, COUNT, DMLC_DTYPE_I32, DMLC_OP_MAX));
    for (int i = 0; i < COUNT; i++) {
        int32_t want = (i % 2 ? (n - 1) * 10 : 0) + i;
        if (ir[i] != want) {
            CHECK(0, "in-place max[%d] = %d, want %d", i, ir[i], want);
            break;
        }
    }

    /* broadcast f64 from the last rank, in place on the root. */
    double *dr = dmlc_buffer_data(recv);
    for (int i = 0; i < COUNT; i++)
        dr[i] = rank == n - 1 ? 0.5 * i : -1.0;
    MUST(dmlc_broadcast(dev, NULL, recv, COUNT, DMLC_DTYPE_F64, (uint32_t)(n - 1)));
    for (int i = 0; i < COUNT; i++) {
        if (dr[i] != 0.5 * i) {
            CHECK(0, "broadcast[%d] = %g", i, dr[i]);
            break;
        }
    }

    /* reduce u64 sum to root 0; other ranks pass no output. */
    uint64_t *us = dmlc_buffer_data(send), *ur = dmlc_buffer_data(recv);
    for (int i = 0; i < COUNT; i++)
        us[i] = (uint64_t)rank << 32 | (uint64_t)i;
    memset(ur, 0, COUNT * 8);
    MUST(dmlc_reduce(dev, send, rank == 0 ? recv : NULL, COUNT, DMLC_DTYPE_U64, DMLC_OP_SUM, 0));
    if (rank == 0) {
        for (int i = 0; i < COUNT; i++) {
            uint64_t want = ((uint64_t)(n * (n - 1) / 2) << 32) + (uint64_t)n * (uint64_t)i;
            if (ur[i] != want) {
                CHECK(0, "reduce[%d] = %llu", i, (unsigned long long)ur[i]);
                break;
            }
        }
    }

    /* allgather u8. */
    uint8_t *bs = dmlc_buffer_data(send), *br = dmlc_buffer_data(recv);
    for (int i = 0; i < COUNT; i++)
        bs[i] = (uint8_t)(rank * 7 + i);
    MUST(dmlc_allgather(dev, send, recv, COUNT, DMLC_DTYPE_U8));
    for (int r = 0; r < n; r++)
        for (int i = 0; i < COUNT; i++)
            if (br[r * COUNT + i] != (uint8_t)(r * 7 + i)) {
                CHECK(0, "allgather[%d][%d] = %u", r, i, br[r * COUNT + i]);
                r = n;
                break;
            }

    /* reduce-scatter i64 sum: block b of rank r's input holds r + b. */
    int64_t *ls = dmlc_buffer_data(send), *lr = dmlc_buffer_data(recv);
    int block = COUNT / 4;
    for (int b = 0; b < n; b++)
        for (int i = 0; i < block; i++)
            ls[b * block + i] = (int64_t)(rank + b) * 1000 - i;
    MUST(dmlc_reduce_scatter(dev, send, recv, (uint64_t)block, DMLC_DTYPE_I64, DMLC_OP_SUM));
    for (int i = 0; i < block; i++) {
        int64_t want = (int64_t)(n * (n - 1) / 2 + n * rank) * 1000 - (int64_t)n * i;
        if (lr[i] != want) {
            CHECK(0, "reduce_scatter[%d] = %lld, want %lld", i, (long long)lr[i], (long long)want);
            break;
        }
    }

    MUST(dmlc_barrier(dev));

    /* allreduce on ordinary memory through the bounce buffer. */
    double host[257];
    for (int i = 0; i < 257; i++)
        host[i] = rank * 0.25 + i;
    MUST(dmlc_allreduce_host(dev, NULL, host, 257, DMLC_DTYPE_F64, DMLC_OP_AVG));
    for (int i = 0; i < 257; i++) {
        double sum = 0.0;
        for (int r = 0; r < n; r++)
            sum += r * 0.25 + i;
        if (host[i] != sum / n) {
            CHECK(0, "allreduce_host[%d] = %g, want %g", i, host[i], sum / n);
            break;
        }
    }

    /* The other collectives on ordinary memory. */
    {
        int32_t b[100], g[100 * 8], mine[3] = {rank, 10 * rank, -rank};
        float rs_in[8 * 5], rs_out[5];
        CHECK(n <= 8, "world of %d is above this test's arrays", n);
        for (int i = 0; i < 100; i++)
            b[i] = rank == n - 1 ? i * 3 : -1;
        MUST(dmlc_broadcast_host(dev, b, 100, DMLC_DTYPE_I32, (uint32_t)(n - 1)));
        for (int i = 0; i < 100; i++)
            if (b[i] != i * 3) {
                CHECK(0, "broadcast_host[%d] = %d", i, b[i]);
                break;
            }
        for (int i = 0; i < 100; i++)
            b[i] = rank + i;
        MUST(dmlc_reduce_host(dev, b, 100, DMLC_DTYPE_I32, DMLC_OP_MAX, 0));
        for (int i = 0; i < 100; i++)
            if (b[i] != (rank == 0 ? n - 1 + i : rank + i)) {
                CHECK(0, "reduce_host[%d] = %d on rank %d", i, b[i], rank);
                break;
            }
        MUST(dmlc_allgather_host(dev, mine, g, 3, DMLC_DTYPE_I32));
        for (int r = 0; r < n; r++)
            CHECK(g[3 * r] == r && g[3 * r + 1] == 10 * r && g[3 * r + 2] == -r,
                  "allgather_host block %d", r);
        for (int i = 0; i < n * 5; i++)
            rs_in[i] = (float)(rank * 100 + i);
        MUST(dmlc_reduce_scatter_host(dev, rs_in, rs_out, 5, DMLC_DTYPE_F32, DMLC_OP_SUM));
        for (int i = 0; i < 5; i++) {
            float want = 0.0f;
            for (int r = 0; r < n; r++)
                want += (float)(r * 100 + rank * 5 + i);
            CHECK(rs_out[i] == want, "reduce_scatter_host[%d] = %g, want %g", i, rs_out[i], want);
        }
        CHECK(dmlc_reduce_host(dev, NULL, 1, DMLC_DTYPE_I32, DMLC_OP_SUM, 0) ==
                  DMLC_ERR_INVALID_ARGUMENT, "reduce_host NULL");
        dmlc_completion why = {0, 0, 0, 7};
        dmlc_last_error_completion(&why);
        CHECK(why.status == DMLC_ERR_INVALID_ARGUMENT && why.detail == 0 &&
                  why.peer == DMLC_NO_PEER && why.generation == 0,
              "report of a local error: %d %u %u", why.status, why.detail, why.peer);
        /* A host form returns only a status: the device's detail and peer
         * of its failed request come from dmlc_last_error_completion. Each
         * member gives another count: a mismatch, reported to both. */
        if (n >= 2) {
            int32_t m[2] = {1, 2};
            CHECK(dmlc_allreduce_host(dev, NULL, m, rank == 0 ? 1 : 2, DMLC_DTYPE_I32,
                                      DMLC_OP_SUM) == DMLC_ERR_MISMATCH,
                  "allreduce_host with another count than the peer's");
            dmlc_last_error_completion(&why);
            CHECK(why.status == DMLC_ERR_MISMATCH && why.detail != 0 &&
                      why.peer < (uint32_t)n,
                  "report of a mismatch: %d %u %u", why.status, why.detail, why.peer);
            /* A success leaves the report of the last failure. */
            MUST(dmlc_barrier(dev));
            dmlc_last_error_completion(&why);
            CHECK(why.status == DMLC_ERR_MISMATCH, "report kept after a success");
        }
        dmlc_last_error_completion(NULL);
        uint64_t chunk = dmlc_host_chunk_bytes(dev);
        uint64_t want_chunk = cfg.max_bytes < (16u << 20) ? cfg.max_bytes : (16u << 20);
        CHECK(chunk == want_chunk / 8 * 8, "host chunk %llu, max_bytes %llu",
              (unsigned long long)chunk, (unsigned long long)cfg.max_bytes);
        CHECK(dmlc_host_chunk_bytes(NULL) == 0, "host chunk of NULL");
    }

    /* Two requests in flight on queue 0, each in two input segments. */
    uint32_t *a = dmlc_buffer_data(send), *ra = dmlc_buffer_data(recv);
    for (int i = 0; i < 200; i++)
        a[i] = (uint32_t)(rank + 1) * (uint32_t)(i + 1);
    dmlc_request req = {DMLC_OPCODE_ALLREDUCE, DMLC_DTYPE_U32, DMLC_OP_SUM, 0, 100, 5, 0, 0};
    dmlc_handle *h1 = NULL, *h2 = NULL;
    dmlc_segment in1[2] = {{send, 0, 160}, {send, 160, 240}};
    dmlc_segment out1 = {recv, 0, 400};
    dmlc_segment in2 = {send, 400, 400};
    dmlc_segment out2[2] = {{recv, 400, 4}, {recv, 404, 396}};
    MUST(dmlc_submit(dev, 0, &req, in1, 2, &out1, 1, &h1));
    MUST(dmlc_submit(dev, 0, &req, &in2, 1, out2, 2, &h2));
    dmlc_completion c2, c1;
    MUST(dmlc_wait(dev, h2, 10000, &c2));
    MUST(dmlc_wait(dev, h1, -1, &c1));
    CHECK(c1.status == DMLC_OK && c1.generation >= 1 && c2.peer == DMLC_NO_PEER, "completion");
    for (int i = 0; i < 200; i++) {
        uint32_t want = (uint32_t)(n * (n + 1) / 2) * (uint32_t)(i + 1);
        if (ra[i] != want) {
            CHECK(0, "submit[%d] = %u, want %u", i, ra[i], want);
            break;
        }
    }

    dmlc_free(send);
    dmlc_free(recv);
    dmlc_free(small);
    dmlc_close(dev);
    if (failures) {
        fprintf(stderr, "FAIL rank %d: %d check(s) failed\n", rank, failures);
        return 1;
    }
    printf("PASS rank %d of %d\n", rank, n);
    return 0;
}
