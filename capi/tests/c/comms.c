/*
 * C ABI test of communicators, send and receive, all-to-all, gather and
 * scatter (spec 5.X.6.13; run by tests/c_abi.rs, one process per rank, 4
 * ranks, against a daemon whose max_bytes is MAX_BYTES so that messages and
 * block collectives are cut into several requests).
 *
 *   comms SOCKET      every operation through the C API, each rank checking
 *                     its results against values it computes itself; prints
 *                     "PASS rank R of N" and exits 0
 */
#include "dmlc_guest.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The daemon's --max-bytes in tests/c_abi.rs: not a multiple of 8, so the
 * pieces of a message are max_bytes rounded down to whole elements. */
#define MAX_BYTES 65540u

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

#define MUST(call)                                                              \
    do {                                                                        \
        int rc_ = (call);                                                       \
        if (rc_ != DMLC_OK) {                                                   \
            fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call, \
                    dmlc_strerror(rc_), dmlc_last_error_message());             \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

/* Element k that rank i gives rank j: every value says where it came from. */
static int32_t val(uint32_t i, uint32_t j, uint64_t k)
{
    return (int32_t)(1000000 * i + 10000 * j + k);
}

/* Checks n elements of got against want; reports the first that differs. */
static int same(const int32_t *got, const int32_t *want, size_t n, const char *what)
{
    for (size_t x = 0; x < n; x++)
        if (got[x] != want[x]) {
            CHECK(0, "%s[%zu] = %d, want %d", what, x, got[x], want[x]);
            return 0;
        }
    return 1;
}

static void *must_alloc(size_t bytes)
{
    void *p = calloc(bytes ? bytes : 1, 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

/* Refused locally with a status, never a crash. */
static void misuse(dmlc_device *dev, uint32_t rank, uint32_t n)
{
    dmlc_comm_info info = {7, 7, 7};
    dmlc_completion why;
    int32_t x[2] = {0, 0};
    CHECK(dmlc_get_comm_info(dev, 0, NULL) == DMLC_ERR_INVALID_ARGUMENT, "info NULL out");
    CHECK(dmlc_get_comm_info(NULL, 0, &info) == DMLC_ERR_INVALID_ARGUMENT, "info NULL dev");
    CHECK(dmlc_get_comm_info(dev, 12345, &info) == DMLC_ERR_BAD_REQUEST && info.id == 0,
          "info of an unknown communicator");
    dmlc_last_error_completion(&why);
    CHECK(why.detail == DMLC_BAD_COMM, "detail %u", why.detail);
    CHECK(dmlc_comm_split(dev, 0, 0, 0, NULL) == DMLC_ERR_INVALID_ARGUMENT, "split NULL out");
    CHECK(dmlc_comm_create(dev, 0, NULL, 2, 0, &info) == DMLC_ERR_INVALID_ARGUMENT,
          "create NULL ranks");
    CHECK(dmlc_send(dev, 0, rank, 0, DMLC_DTYPE_I32, x, 2) == DMLC_ERR_BAD_REQUEST,
          "send to itself");
    dmlc_last_error_completion(&why);
    CHECK(why.detail == DMLC_BAD_PEER, "detail %u", why.detail);
    CHECK(dmlc_recv(dev, 0, n, 0, DMLC_DTYPE_I32, x, 2, NULL, NULL) == DMLC_ERR_BAD_REQUEST,
          "receive from a rank beyond the group");
    CHECK(dmlc_send(dev, 12345, 0, 0, DMLC_DTYPE_I32, x, 2) == DMLC_ERR_BAD_REQUEST,
          "send on an unknown communicator");
    CHECK(dmlc_send(dev, 0, (rank + 1) % n, 0, DMLC_DTYPE_I32, NULL, 2) ==
              DMLC_ERR_INVALID_ARGUMENT, "send NULL");
    CHECK(dmlc_send(dev, 0, (rank + 1) % n, 0, 42, x, 2) == DMLC_ERR_UNSUPPORTED,
          "send of an unknown dtype");
    CHECK(dmlc_gather(dev, 0, x, x, 1, DMLC_DTYPE_I32, n) == DMLC_ERR_BAD_REQUEST,
          "gather to a root beyond the group");
    CHECK(dmlc_alltoallv(dev, 0, x, x, NULL, NULL, DMLC_DTYPE_I32) == DMLC_ERR_INVALID_ARGUMENT,
          "alltoallv NULL counts");
    CHECK(dmlc_comm_free(dev, 0) == DMLC_ERR_BAD_REQUEST, "free of the group");
    CHECK(dmlc_comm_call(dev, 0, NULL, NULL, 0, NULL, 0, NULL) == DMLC_ERR_INVALID_ARGUMENT,
          "call NULL request");
    CHECK(dmlc_comm_features(NULL) == -1 && dmlc_max_comms(NULL) == -1, "NULL device");
    CHECK(dmlc_last_error_length() == 0, "length after a failure other than TRUNCATE");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    dmlc_open_options opts;
    dmlc_open_options_init(&opts);
    opts.dma_bytes = 16u << 20;
    dmlc_device *dev = NULL;
    MUST(dmlc_open_host_ex(argv[1], &opts, &dev));
    uint32_t rank = (uint32_t)dmlc_rank(dev), n = (uint32_t)dmlc_world_size(dev);
    CHECK(n == 4, "world of %u, this test needs 4", n);
    CHECK(dmlc_comm_features(dev) ==
              (int)(DMLC_FEATURE_COMM | DMLC_FEATURE_P2P | DMLC_FEATURE_BLOCKS),
          "features %d", dmlc_comm_features(dev));
    CHECK(dmlc_max_comms(dev) == 64, "max_comms %d", dmlc_max_comms(dev));
    dmlc_comm_info world;
    MUST(dmlc_get_comm_info(dev, DMLC_COMM_WORLD, &world));
    CHECK(world.id == 0 && world.rank == rank && world.size == n, "world %u %u %u", world.id,
          world.rank, world.size);
    misuse(dev, rank, n);

    /* Even and odd ranks, the higher ranks first (key n - rank). */
    dmlc_comm_info mine;
    MUST(dmlc_comm_split(dev, DMLC_COMM_WORLD, rank % 2, n - rank, &mine));
    uint32_t partner = rank ^ 2; /* the other member of mine */
    CHECK(mine.id != 0 && mine.size == 2 && mine.rank == (rank < 2 ? 1u : 0u),
          "split: id %u rank %u size %u", mine.id, mine.rank, mine.size);
    dmlc_comm_info again;
    MUST(dmlc_get_comm_info(dev, mine.id, &again));
    CHECK(again.id == mine.id && again.rank == mine.rank && again.size == 2, "info");
    /* Group rank of rank x of mine. */
#define GROUP_OF(x) ((x) == mine.rank ? rank : partner)

    /* The collectives on ordinary memory, on mine. */
    {
        enum { C = 20000 }; /* 80000 bytes: more than one request */
        int32_t *a = must_alloc(C * 4), *b = must_alloc(C * 4), *w = must_alloc(C * 4);
        for (uint32_t k = 0; k < C; k++) {
            a[k] = val(rank, 0, k);
            w[k] = val(rank, 0, k) + val(partner, 0, k);
        }
        MUST(dmlc_allreduce_host_comm(dev, mine.id, a, b, C, DMLC_DTYPE_I32, DMLC_OP_SUM));
        same(b, w, C, "allreduce_host_comm");
        MUST(dmlc_allreduce_host_comm(dev, mine.id, NULL, a, C, DMLC_DTYPE_I32, DMLC_OP_SUM));
        same(a, w, C, "in-place allreduce_host_comm");
        /* Broadcast from rank 1 of mine (the lower group rank). */
        for (uint32_t k = 0; k < C; k++) {
            a[k] = val(rank, 1, k);
            w[k] = val(GROUP_OF(1), 1, k);
        }
        MUST(dmlc_broadcast_host_comm(dev, mine.id, a, C, DMLC_DTYPE_I32, 1));
        same(a, w, C, "broadcast_host_comm");
        /* Reduce (max) to rank 0 of mine. */
        for (uint32_t k = 0; k < C; k++) {
            a[k] = val(rank, 2, k);
            w[k] = mine.rank == 0 ? val(rank > partner ? rank : partner, 2, k) : val(rank, 2, k);
        }
        MUST(dmlc_reduce_host_comm(dev, mine.id, a, C, DMLC_DTYPE_I32, DMLC_OP_MAX, 0));
        same(a, w, C, "reduce_host_comm");
        /* Allgather: 2 blocks of C/2 in the order of mine. */
        for (uint32_t k = 0; k < C / 2; k++)
            a[k] = val(rank, 3, k);
        for (uint32_t x = 0; x < 2; x++)
            for (uint32_t k = 0; k < C / 2; k++)
                w[x * (C / 2) + k] = val(GROUP_OF(x), 3, k);
        MUST(dmlc_allgather_host_comm(dev, mine.id, a, b, C / 2, DMLC_DTYPE_I32));
        same(b, w, C, "allgather_host_comm");
        /* Reduce-scatter: block x of every input; mine.rank's block summed. */
        for (uint32_t k = 0; k < C; k++)
            a[k] = val(rank, 4, k);
        for (uint32_t k = 0; k < C / 2; k++) {
            uint64_t at = mine.rank * (C / 2) + k;
            w[k] = val(rank, 4, at) + val(partner, 4, at);
        }
        MUST(dmlc_reduce_scatter_host_comm(dev, mine.id, a, b, C / 2, DMLC_DTYPE_I32,
                                           DMLC_OP_SUM));
        same(b, w, C / 2, "reduce_scatter_host_comm");
        MUST(dmlc_barrier_comm(dev, mine.id));
        /* On the group, the _comm forms are the host forms. */
        for (uint32_t k = 0; k < 10; k++)
            a[k] = (int32_t)(rank + k);
        MUST(dmlc_allreduce_host_comm(dev, DMLC_COMM_WORLD, NULL, a, 10, DMLC_DTYPE_I32,
                                      DMLC_OP_SUM));
        for (uint32_t k = 0; k < 10; k++)
            w[k] = (int32_t)(n * (n - 1) / 2 + n * k);
        same(a, w, 10, "allreduce_host_comm on the group");
        free(a);
        free(b);
        free(w);
    }

    /* Device buffers on mine: dmlc_submit_comm (non-blocking), and
     * dmlc_comm_call for a gather to rank 0 of mine. */
    {
        dmlc_buffer *in = NULL, *out = NULL;
        MUST(dmlc_alloc(dev, 64 * 4, &in));
        MUST(dmlc_alloc(dev, 64 * 4, &out));
        int32_t *pi = dmlc_buffer_data(in), *po = dmlc_buffer_data(out), w[64];
        for (uint32_t k = 0; k < 16; k++) {
            pi[k] = val(rank, 5, k);
            w[k] = val(rank, 5, k) + val(partner, 5, k);
        }
        dmlc_request req = {DMLC_OPCODE_ALLREDUCE, DMLC_DTYPE_I32, DMLC_OP_SUM, 0, 16, 0, 0, 0};
        dmlc_segment si = {in, 0, 64}, so = {out, 0, 64};
        dmlc_handle *h = NULL;
        MUST(dmlc_submit_comm(dev, 0, mine.id, &req, &si, 1, &so, 1, &h));
        dmlc_completion done;
        MUST(dmlc_wait(dev, h, -1, &done));
        same(po, w, 16, "submit_comm allreduce");
        for (uint32_t k = 0; k < 8; k++)
            pi[k] = val(rank, 6, k);
        dmlc_comm_request g = {DMLC_OPCODE_GATHER, DMLC_DTYPE_I32, 0, 0, 8, 0, 0, 0,
                               mine.id, 0, 0, 0, NULL};
        dmlc_segment gi = {in, 0, 32}, go = {out, 0, 64};
        dmlc_comm_completion cc;
        MUST(dmlc_comm_call(dev, 0, &g, &gi, 1, &go, mine.rank == 0 ? 1 : 0, &cc));
        CHECK(cc.status == DMLC_OK && cc.generation >= 1, "gather completion %d", cc.status);
        if (mine.rank == 0) {
            for (uint32_t x = 0; x < 2; x++)
                for (uint32_t k = 0; k < 8; k++)
                    w[x * 8 + k] = val(GROUP_OF(x), 6, k);
            same(po, w, 16, "comm_call gather");
        }
        /* A send and its receive through dmlc_comm_call, on the group:
         * ranks 0 and 1; the completion names the sender. */
        if (rank < 2) {
            dmlc_comm_request p = {rank == 0 ? DMLC_OPCODE_SEND : DMLC_OPCODE_RECV,
                                   DMLC_DTYPE_I32, 0, 0, 4, 9, 0, 0, 0, 1 - rank, 0, 0, NULL};
            for (uint32_t k = 0; k < 4; k++)
                pi[k] = val(rank, 7, k);
            dmlc_segment ps = rank == 0 ? gi : go;
            ps.len = 16;
            if (rank == 0)
                MUST(dmlc_comm_call(dev, 0, &p, &ps, 1, NULL, 0, &cc));
            else
                MUST(dmlc_comm_call(dev, 0, &p, NULL, 0, &ps, 1, &cc));
            CHECK(cc.length == 16, "comm_call message length %llu", (unsigned long long)cc.length);
            if (rank == 1) {
                for (uint32_t k = 0; k < 4; k++)
                    w[k] = val(0, 7, k);
                same(po, w, 4, "comm_call receive");
                CHECK(cc.peer == 0 && cc.peer_world == 0, "sender %u %u", cc.peer, cc.peer_world);
            }
        }
        dmlc_free(in);
        dmlc_free(out);
    }

    /* A ring on the group: even ranks send first, odd ranks receive first,
     * from any source; 1.5 pieces of MAX_BYTES, so each message is two. */
    {
        uint64_t c = (MAX_BYTES / 4) * 3 / 2;
        uint32_t to = (rank + 1) % n, from = (rank + n - 1) % n;
        int32_t *msg = must_alloc(c * 4), *room = must_alloc(c * 4), *w = must_alloc(c * 4);
        for (uint64_t k = 0; k < c; k++) {
            msg[k] = val(rank, to, k);
            w[k] = val(from, rank, k);
        }
        uint64_t length = 0;
        uint32_t source = 0;
        if (rank % 2 == 0) {
            MUST(dmlc_send(dev, 0, to, 7, DMLC_DTYPE_I32, msg, c));
            MUST(dmlc_recv(dev, 0, DMLC_ANY_SOURCE, 7, DMLC_DTYPE_I32, room, c, &length,
                           &source));
        } else {
            MUST(dmlc_recv(dev, 0, DMLC_ANY_SOURCE, 7, DMLC_DTYPE_I32, room, c, &length,
                           &source));
            MUST(dmlc_send(dev, 0, to, 7, DMLC_DTYPE_I32, msg, c));
        }
        CHECK(length == c * 4 && source == from, "ring: length %llu from %u",
              (unsigned long long)length, source);
        same(room, w, c, "ring message");
        /* A short message into a larger room (one piece): the rest stays. */
        room[3] = -1;
        if (rank % 2 == 0) {
            MUST(dmlc_send(dev, 0, to, 8, DMLC_DTYPE_I32, msg, 3));
            MUST(dmlc_recv(dev, 0, from, 8, DMLC_DTYPE_I32, room, 100, &length, &source));
        } else {
            MUST(dmlc_recv(dev, 0, from, 8, DMLC_DTYPE_I32, room, 100, &length, &source));
            MUST(dmlc_send(dev, 0, to, 8, DMLC_DTYPE_I32, msg, 3));
        }
        CHECK(length == 12 && source == from && room[3] == -1, "short message: %llu from %u",
              (unsigned long long)length, source);
        same(room, w, 3, "short message");
        /* f64 on mine: pieces of MAX_BYTES rounded down to 8 bytes. */
        uint64_t cd = MAX_BYTES / 8 + 3;
        double *dm = must_alloc(cd * 8), *dr = must_alloc(cd * 8);
        for (uint64_t k = 0; k < cd; k++)
            dm[k] = 0.5 * (double)k + mine.rank;
        if (mine.rank == 0) {
            MUST(dmlc_send(dev, mine.id, 1, 0, DMLC_DTYPE_F64, dm, cd));
        } else {
            MUST(dmlc_recv(dev, mine.id, 0, 0, DMLC_DTYPE_F64, dr, cd, &length, &source));
            CHECK(length == cd * 8 && source == 0, "f64 length %llu", (unsigned long long)length);
            for (uint64_t k = 0; k < cd; k++)
                if (dr[k] != 0.5 * (double)k) {
                    CHECK(0, "f64 message[%llu] = %g", (unsigned long long)k, dr[k]);
                    break;
                }
        }
        free(dm);
        free(dr);
        /* Rank 0 sends 4 elements, rank 1 has room for 2: TRUNCATE on both. */
        if (rank < 2) {
            dmlc_completion why;
            if (rank == 0) {
                CHECK(dmlc_send(dev, 0, 1, 3, DMLC_DTYPE_I32, msg, 4) == DMLC_ERR_TRUNCATE,
                      "send into a small receive");
                CHECK(dmlc_last_error_length() == 8, "room %llu",
                      (unsigned long long)dmlc_last_error_length());
            } else {
                CHECK(dmlc_recv(dev, 0, 0, 3, DMLC_DTYPE_I32, room, 2, &length, &source) ==
                          DMLC_ERR_TRUNCATE, "receive of a large message");
                CHECK(length == 16 && source == 0 && dmlc_last_error_length() == 16,
                      "message %llu from %u", (unsigned long long)length, source);
            }
            dmlc_last_error_completion(&why);
            CHECK(why.status == DMLC_ERR_TRUNCATE && why.peer == 1 - rank, "report %d %u",
                  why.status, why.peer);
        } else {
            /* Above max_bytes the room must be the message's size: a room of
             * two pieces for a message of 1.5 fails on the receive. */
            uint64_t c2 = (MAX_BYTES / 4) * 2;
            int32_t *big = must_alloc(c2 * 4);
            if (rank == 2) {
                MUST(dmlc_send(dev, 0, 3, 4, DMLC_DTYPE_I32, msg, c));
            } else {
                CHECK(dmlc_recv(dev, 0, 2, 4, DMLC_DTYPE_I32, big, c2, &length, &source) ==
                          DMLC_ERR_TRUNCATE, "a room of another size above max_bytes");
                CHECK(length == c * 4 && source == 2, "got %llu from %u",
                      (unsigned long long)length, source);
                CHECK(strstr(dmlc_last_error_message(), "DRV-COMM-2") != NULL, "message");
            }
            free(big);
        }
        free(msg);
        free(room);
        free(w);
    }

    /* Block collectives on the group, cut into several requests. */
    {
        enum { C = 5000 }; /* 20000 bytes a block: more than 65536 / 4 */
        int32_t *s = must_alloc((size_t)n * C * 4), *r = must_alloc((size_t)n * C * 4),
                *w = must_alloc((size_t)n * C * 4);
        for (uint32_t j = 0; j < n; j++)
            for (uint32_t k = 0; k < C; k++) {
                s[j * C + k] = val(rank, j, k);
                w[j * C + k] = val(j, rank, k);
            }
        MUST(dmlc_alltoall(dev, 0, s, r, C, DMLC_DTYPE_I32));
        same(r, w, (size_t)n * C, "alltoall");
        /* Gather to the last rank, out of place; then in place. */
        for (uint32_t k = 0; k < C; k++)
            s[k] = val(rank, 8, k);
        for (uint32_t j = 0; j < n; j++)
            for (uint32_t k = 0; k < C; k++)
                w[j * C + k] = val(j, 8, k);
        memset(r, 0, (size_t)n * C * 4);
        MUST(dmlc_gather(dev, 0, s, rank == n - 1 ? r : NULL, C, DMLC_DTYPE_I32, n - 1));
        if (rank == n - 1)
            same(r, w, (size_t)n * C, "gather");
        if (rank == 0) {
            memset(r, 0, (size_t)n * C * 4);
            memcpy(r, s, C * 4);
        }
        MUST(dmlc_gather(dev, 0, rank == 0 ? NULL : s, r, C, DMLC_DTYPE_I32, 0));
        if (rank == 0)
            same(r, w, (size_t)n * C, "in-place gather");
        /* Scatter from rank 1. */
        for (uint32_t j = 0; j < n; j++)
            for (uint32_t k = 0; k < C; k++)
                s[j * C + k] = val(rank, j, k);
        for (uint32_t k = 0; k < C; k++)
            w[k] = val(1, rank, k);
        MUST(dmlc_scatter(dev, 0, rank == 1 ? s : NULL, r, C, DMLC_DTYPE_I32, 1));
        same(r, w, C, "scatter");
        free(s);
        free(r);
        free(w);
    }

    /* The v forms: rank a of a communicator sends a + 2b + 1 elements to
     * rank b (alltoallv on mine; gatherv and scatterv on the group). */
    {
#define CNT(i, j) ((uint64_t)(i) + 2u * (uint64_t)(j) + 1u)
        uint64_t sc[4], rc[4], si = 0, ri = 0;
        int32_t s[64], r[64], w[64];
        uint32_t a = mine.rank;
        for (uint32_t b = 0; b < 2; b++) {
            sc[b] = CNT(a, b);
            rc[b] = CNT(b, a);
            for (uint64_t k = 0; k < sc[b]; k++)
                s[si++] = val(rank, GROUP_OF(b), k);
            for (uint64_t k = 0; k < rc[b]; k++)
                w[ri++] = val(GROUP_OF(b), rank, k);
        }
        MUST(dmlc_alltoallv(dev, mine.id, s, r, sc, rc, DMLC_DTYPE_I32));
        same(r, w, ri, "alltoallv");
        /* gatherv to rank 2: member j gives j + 1 elements. */
        uint64_t gc[4], total = 0;
        for (uint32_t j = 0; j < n; j++) {
            gc[j] = j + 1;
            for (uint64_t k = 0; k < gc[j]; k++)
                w[total++] = val(j, 9, k);
        }
        for (uint64_t k = 0; k < rank + 1u; k++)
            s[k] = val(rank, 9, k);
        MUST(dmlc_gatherv(dev, 0, s, rank == 2 ? r : NULL, rank + 1u, rank == 2 ? gc : NULL,
                          DMLC_DTYPE_I32, 2));
        if (rank == 2)
            same(r, w, total, "gatherv");
        /* scatterv from rank 3: member j gets 2 * j + 1 elements. */
        uint64_t vc[4], at = 0;
        for (uint32_t j = 0; j < n; j++) {
            vc[j] = 2u * j + 1u;
            for (uint64_t k = 0; k < vc[j]; k++)
                s[at++] = val(rank, j, k);
        }
        for (uint64_t k = 0; k < 2u * rank + 1u; k++)
            w[k] = val(3, rank, k);
        MUST(dmlc_scatterv(dev, 0, rank == 3 ? s : NULL, r, rank == 3 ? vc : NULL,
                           2u * rank + 1u, DMLC_DTYPE_I32, 3));
        same(r, w, 2u * rank + 1u, "scatterv");
        /* Tables that disagree: rank 0 expects 2 elements from rank 1, which
         * sends 1: MISMATCH with the table bit on every member. */
        uint64_t ones[4] = {1, 1, 1, 1}, mine_rc[4] = {1, 1, 1, 1};
        if (rank == 0)
            mine_rc[1] = 2;
        dmlc_completion why;
        CHECK(dmlc_alltoallv(dev, 0, s, r, ones, mine_rc, DMLC_DTYPE_I32) == DMLC_ERR_MISMATCH,
              "alltoallv with tables that disagree");
        dmlc_last_error_completion(&why);
        CHECK(why.status == DMLC_ERR_MISMATCH && (why.detail & DMLC_MISMATCH_TABLE) &&
                  why.peer < n,
              "mismatch report %d %#x %u", why.status, why.detail, why.peer);
    }

    /* comm_create by the odd ranks, 3 first; then every communicator goes. */
    if (rank % 2 == 1) {
        uint32_t ranks[2] = {3, 1};
        dmlc_comm_info made;
        MUST(dmlc_comm_create(dev, 0, ranks, 2, 5, &made));
        CHECK(made.id != 0 && made.id != mine.id && made.size == 2 &&
                  made.rank == (rank == 3 ? 0u : 1u),
              "create: id %u rank %u size %u", made.id, made.rank, made.size);
        int32_t x = (int32_t)rank, y = 0;
        MUST(dmlc_allreduce_host_comm(dev, made.id, &x, &y, 1, DMLC_DTYPE_I32, DMLC_OP_SUM));
        CHECK(y == 4, "allreduce on the created communicator: %d", y);
        MUST(dmlc_comm_free(dev, made.id));
    }
    MUST(dmlc_comm_free(dev, mine.id));
    CHECK(dmlc_get_comm_info(dev, mine.id, &again) == DMLC_ERR_BAD_REQUEST, "info after free");
    CHECK(dmlc_barrier_comm(dev, mine.id) == DMLC_ERR_BAD_REQUEST, "barrier after free");
    MUST(dmlc_barrier_comm(dev, DMLC_COMM_WORLD));

    dmlc_close(dev);
    if (failures) {
        fprintf(stderr, "FAIL rank %u: %d check(s) failed\n", rank, failures);
        return 1;
    }
    printf("PASS rank %u of %u\n", rank, n);
    return 0;
}
