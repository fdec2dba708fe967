/*
 * Test of the rabit-style C API (dmlc_rabit.h), run by tests/c_rabit.rs,
 * one process per worker, configured by the DMLC environment.
 *
 *   rabit run [DMLC_X=V ...]    every call through the C API, checked for
 *                               any world size; prints "PASS rank R of N"
 *   rabit init [DMLC_X=V ...]   prints "init STATUS MESSAGE" for RabitInit
 *                               (then finalizes if it worked); exits 0
 *   rabit lost                  rank 1 quits without RabitFinalize; rank 0
 *                               prints "lost STATUS MESSAGE" for the
 *                               allreduce that follows
 *   rabit --constants           prints "NAME VALUE" for the header's
 *                               constants and the sizes of the C types
 */
#include "dmlc_rabit.h"

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
            fprintf(stderr, " (last error: %s)\n", RabitGetLastError());        \
            failures++;                                                         \
        }                                                                       \
    } while (0)

/* A call that must succeed; on failure exit (later checks would cascade). */
#define MUST(call)                                                              \
    do {                                                                        \
        int rc_ = (call);                                                       \
        if (rc_ != RABIT_OK) {                                                  \
            fprintf(stderr, "%s:%d: %s failed (%d): %s\n", __FILE__, __LINE__, #call, rc_, \
                    RabitGetLastError());                                       \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

/* A call that must fail with `want` and leave a message. */
#define REFUSED(call, want)                                                     \
    do {                                                                        \
        int rc_ = (call);                                                       \
        CHECK(rc_ == (want), "%s returned %d, want %d", #call, rc_, (int)(want)); \
        CHECK(RabitGetLastError()[0] != '\0', "no message after %s", #call);  \
    } while (0)

#define PRINT(name) printf("%s %lld\n", #name, (long long)(name))
#define SIZE(dtype, ctype) printf("size(%s) %zu\n", #dtype, sizeof(ctype))

static int constants(void)
{
    PRINT(RABIT_OK);
    PRINT(RABIT_ERR_INVALID_ARGUMENT);
    PRINT(RABIT_ERR_NOT_INITIALIZED);
    PRINT(RABIT_ERR_ALREADY_INITIALIZED);
    PRINT(RABIT_ERR_ENVIRONMENT);
    PRINT(RABIT_ERR_CONNECT);
    PRINT(RABIT_ERR_UNSUPPORTED);
    PRINT(RABIT_ERR_MISMATCH);
    PRINT(RABIT_ERR_PEER_LOST);
    PRINT(RABIT_ERR_TIMEOUT);
    PRINT(RABIT_ERR_COLLECTIVE);
    PRINT(RABIT_ERR_INTERNAL);
    PRINT(RABIT_CHAR);
    PRINT(RABIT_UCHAR);
    PRINT(RABIT_INT);
    PRINT(RABIT_UINT);
    PRINT(RABIT_LONG);
    PRINT(RABIT_ULONG);
    PRINT(RABIT_FLOAT);
    PRINT(RABIT_DOUBLE);
    PRINT(RABIT_LONGLONG);
    PRINT(RABIT_ULONGLONG);
    PRINT(RABIT_HALF);
    PRINT(RABIT_BFLOAT16);
    PRINT(RABIT_MAX);
    PRINT(RABIT_MIN);
    PRINT(RABIT_SUM);
    PRINT(RABIT_BITOR);
    PRINT(RABIT_BITAND);
    PRINT(RABIT_BITXOR);
    PRINT(RABIT_PROD);
    PRINT(RABIT_AVG);
    PRINT(sizeof(rbt_ulong));
    SIZE(RABIT_CHAR, signed char);
    SIZE(RABIT_UCHAR, unsigned char);
    SIZE(RABIT_INT, int);
    SIZE(RABIT_UINT, unsigned int);
    SIZE(RABIT_LONG, long);
    SIZE(RABIT_ULONG, unsigned long);
    SIZE(RABIT_FLOAT, float);
    SIZE(RABIT_DOUBLE, double);
    SIZE(RABIT_LONGLONG, long long);
    SIZE(RABIT_ULONGLONG, unsigned long long);
    SIZE(RABIT_HALF, uint16_t);
    SIZE(RABIT_BFLOAT16, uint16_t);
    return 0;
}

/* Bits of a float. */
static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* binary16 bits of a small non-negative integer (exact). */
static uint16_t half_of_int(int v)
{
    if (v == 0)
        return 0;
    uint32_t u = f32_bits((float)v);
    uint32_t exp = ((u >> 23) & 0xff) - 127 + 15;
    return (uint16_t)(exp << 10 | (u & 0x7fffff) >> 13);
}

/* bfloat16 bits of a float that bfloat16 holds exactly. */
static uint16_t bf16_of(float f)
{
    return (uint16_t)(f32_bits(f) >> 16);
}

enum { N = 64 };

struct prepare_state {
    float *buf;
    int calls;
};

/* rabit's lazy preparation: fills the buffer just before the allreduce,
 * asking the library for the rank (no deadlock with the worker's lock). */
static void prepare(void *arg)
{
    struct prepare_state *s = arg;
    int rank = RabitGetRank();
    for (int i = 0; i < N; i++)
        s->buf[i] = (float)(rank + 1) * (float)i * 0.5f;
    s->calls++;
}

/* Calls before RabitInit: queries give the lone-worker answers,
 * collectives are refused. */
static void before_init(void)
{
    float f = 1.0f;
    CHECK(RabitGetRank() == 0 && RabitGetWorldSize() == 1 && RabitIsDistributed() == 0,
          "queries before init");
    REFUSED(RabitAllreduce(&f, 1, RABIT_FLOAT, RABIT_SUM, NULL, NULL), RABIT_ERR_NOT_INITIALIZED);
    CHECK(strstr(RabitGetLastError(), "RabitInit") != NULL, "message: %s", RabitGetLastError());
    REFUSED(RabitBroadcast(&f, sizeof f, 0), RABIT_ERR_NOT_INITIALIZED);
    REFUSED(RabitBarrier(), RABIT_ERR_NOT_INITIALIZED);
    REFUSED(RabitFinalize(), RABIT_ERR_NOT_INITIALIZED);
    REFUSED(RabitInit(-1, NULL), RABIT_ERR_INVALID_ARGUMENT);
    REFUSED(RabitInit(1, NULL), RABIT_ERR_INVALID_ARGUMENT);
}

static void allreduce_every_dtype(int rank, int n)
{
    /* rabit's basic example: int max, then sum. */
    int a[N];
    for (int i = 0; i < N; i++)
        a[i] = rank + i;
    MUST(RabitAllreduce(a, N, RABIT_INT, RABIT_MAX, NULL, NULL));
    for (int i = 0; i < N; i++)
        CHECK(a[i] == n - 1 + i, "int max[%d] = %d", i, a[i]);
    MUST(RabitAllreduce(a, N, RABIT_INT, RABIT_SUM, NULL, NULL));
    for (int i = 0; i < N; i++)
        CHECK(a[i] == n * (n - 1 + i), "int sum[%d] = %d", i, a[i]);

    /* float sum, filled by prepare_fun. */
    float f[N];
    struct prepare_state st = {f, 0};
    memset(f, 0xff, sizeof f);
    MUST(RabitAllreduce(f, N, RABIT_FLOAT, RABIT_SUM, prepare, &st));
    CHECK(st.calls == 1, "prepare_fun called %d times", st.calls);
    for (int i = 0; i < N; i++)
        CHECK(f[i] == (float)(n * (n + 1) / 2) * (float)i * 0.5f, "float sum[%d] = %g", i, f[i]);

    double d[N];
    for (int i = 0; i < N; i++)
        d[i] = -1.5 * rank + i;
    MUST(RabitAllreduce(d, N, RABIT_DOUBLE, RABIT_MIN, NULL, NULL));
    for (int i = 0; i < N; i++)
        CHECK(d[i] == -1.5 * (n - 1) + i, "double min[%d] = %g", i, d[i]);

    /* char sum wraps. */
    signed char c[3] = {100, -100, (signed char)rank};
    MUST(RabitAllreduce(c, 3, RABIT_CHAR, RABIT_SUM, NULL, NULL));
    CHECK(c[0] == (signed char)(uint8_t)(100 * n) && c[1] == (signed char)(uint8_t)(-100 * n) &&
              c[2] == n * (n - 1) / 2,
          "char sum = %d %d %d", c[0], c[1], c[2]);

    unsigned char uc = (unsigned char)(1u << rank);
    MUST(RabitAllreduce(&uc, 1, RABIT_UCHAR, RABIT_BITOR, NULL, NULL));
    CHECK(uc == (1u << n) - 1, "uchar bitor = %u", uc);

    unsigned int ui[2] = {~(1u << rank), 0xf0f0f0f0u};
    MUST(RabitAllreduce(ui, 2, RABIT_UINT, RABIT_BITAND, NULL, NULL));
    CHECK(ui[0] == ~((1u << n) - 1) && ui[1] == 0xf0f0f0f0u, "uint bitand = %x %x", ui[0], ui[1]);

    long l = (long)(rank + 1) << 20, lx = 0;
    for (int r = 0; r < n; r++)
        lx ^= (long)(r + 1) << 20;
    MUST(RabitAllreduce(&l, 1, RABIT_LONG, RABIT_BITXOR, NULL, NULL));
    CHECK(l == lx, "long bitxor = %ld, want %ld", l, lx);

    unsigned long ul = 3, up = 1;
    for (int r = 0; r < n; r++)
        up *= 3;
    MUST(RabitAllreduce(&ul, 1, RABIT_ULONG, RABIT_PROD, NULL, NULL));
    CHECK(ul == up, "ulong prod = %lu, want %lu", ul, up);

    /* long long avg truncates toward zero, as C division does. */
    long long ll = 10LL * rank - 7, lls = 0;
    for (int r = 0; r < n; r++)
        lls += 10LL * r - 7;
    MUST(RabitAllreduce(&ll, 1, RABIT_LONGLONG, RABIT_AVG, NULL, NULL));
    CHECK(ll == lls / n, "long long avg = %lld, want %lld", ll, lls / n);

    /* unsigned long long sum wraps. */
    unsigned long long ull = (1ULL << 63) + (unsigned long long)rank, ulls = 0;
    for (int r = 0; r < n; r++)
        ulls += (1ULL << 63) + (unsigned long long)r;
    MUST(RabitAllreduce(&ull, 1, RABIT_ULONGLONG, RABIT_SUM, NULL, NULL));
    CHECK(ull == ulls, "ull sum = %llu, want %llu", ull, ulls);

    uint16_t h[2] = {half_of_int(1), half_of_int(rank)};
    MUST(RabitAllreduce(h, 2, RABIT_HALF, RABIT_SUM, NULL, NULL));
    CHECK(h[0] == half_of_int(n) && h[1] == half_of_int(n * (n - 1) / 2), "half sum = %04x %04x",
          h[0], h[1]);

    uint16_t b = bf16_of((float)rank);
    MUST(RabitAllreduce(&b, 1, RABIT_BFLOAT16, RABIT_AVG, NULL, NULL));
    CHECK(b == bf16_of((float)(n - 1) / 2.0f), "bf16 avg = %04x", b);

    /* Nothing to reduce: fine, even without a buffer. */
    MUST(RabitAllreduce(NULL, 0, RABIT_DOUBLE, RABIT_SUM, NULL, NULL));

    /* Refused locally, so the workers stay in step. */
    REFUSED(RabitAllreduce(f, N, RABIT_FLOAT, RABIT_BITOR, NULL, NULL), RABIT_ERR_UNSUPPORTED);
    REFUSED(RabitAllreduce(f, N, 42, RABIT_SUM, NULL, NULL), RABIT_ERR_INVALID_ARGUMENT);
    REFUSED(RabitAllreduce(f, N, RABIT_FLOAT, 42, NULL, NULL), RABIT_ERR_INVALID_ARGUMENT);
    REFUSED(RabitAllreduce(NULL, 1, RABIT_FLOAT, RABIT_SUM, NULL, NULL),
            RABIT_ERR_INVALID_ARGUMENT);
    REFUSED(RabitAllreduce(f, (size_t)-1, RABIT_DOUBLE, RABIT_SUM, NULL, NULL),
            RABIT_ERR_INVALID_ARGUMENT);
}

static void broadcasts(int rank, int n)
{
    /* A large block from the last rank (several requests' worth on small
     * devices is not needed: the library splits by itself). */
    enum { BIG = 300000 };
    unsigned char *big = malloc(BIG);
    if (!big) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (int i = 0; i < BIG; i++)
        big[i] = rank == n - 1 ? (unsigned char)(i * 7 + 3) : 0;
    MUST(RabitBroadcast(big, BIG, n - 1));
    for (int i = 0; i < BIG; i++)
        if (big[i] != (unsigned char)(i * 7 + 3)) {
            CHECK(0, "broadcast[%d] = %u", i, big[i]);
            break;
        }
    free(big);

    /* rabit's string idiom: the length first, then the bytes. */
    char text[64] = "";
    if (rank == 0)
        strcpy(text, "model v1: w = 0.25");
    rbt_ulong len = rank == 0 ? (rbt_ulong)strlen(text) : 0;
    MUST(RabitBroadcast(&len, sizeof len, 0));
    CHECK(len == 18, "broadcast length %lu", len);
    MUST(RabitBroadcast(text, len, 0));
    CHECK(strcmp(text, "model v1: w = 0.25") == 0, "broadcast text \"%s\"", text);

    MUST(RabitBroadcast(NULL, 0, 0));
    REFUSED(RabitBroadcast(text, 4, n), RABIT_ERR_INVALID_ARGUMENT);
    REFUSED(RabitBroadcast(text, 4, -1), RABIT_ERR_INVALID_ARGUMENT);
    REFUSED(RabitBroadcast(NULL, 4, 0), RABIT_ERR_INVALID_ARGUMENT);
}

static int run(int argc, char **argv)
{
    before_init();
    MUST(RabitInit(argc, argv));
    REFUSED(RabitInit(argc, argv), RABIT_ERR_ALREADY_INITIALIZED);
    int rank = RabitGetRank(), n = RabitGetWorldSize();
    const char *id = getenv("DMLC_TASK_ID"), *num = getenv("DMLC_NUM_WORKER");
    if (id && *id)
        CHECK(rank == atoi(id), "rank %d, DMLC_TASK_ID %s", rank, id);
    if (num && *num)
        CHECK(n == atoi(num), "world size %d, DMLC_NUM_WORKER %s", n, num);
    CHECK(rank >= 0 && rank < n, "rank %d of %d", rank, n);
    CHECK(RabitIsDistributed() == (n > 1), "is distributed");

    allreduce_every_dtype(rank, n);
    broadcasts(rank, n);
    MUST(RabitBarrier());

    char name[256];
    rbt_ulong name_len = 0;
    MUST(RabitGetProcessorName(name, &name_len, sizeof name));
    CHECK(name_len == strlen(name) && name_len > 0, "processor name \"%s\" (%lu)", name, name_len);
    REFUSED(RabitGetProcessorName(NULL, &name_len, 8), RABIT_ERR_INVALID_ARGUMENT);
    REFUSED(RabitTrackerPrint(NULL), RABIT_ERR_INVALID_ARGUMENT);

    char msg[128];
    snprintf(msg, sizeof msg, "tracker: rank %d of %d says hello\nsecond line", rank, n);
    MUST(RabitTrackerPrint(msg));

    MUST(RabitFinalize());
    CHECK(RabitGetRank() == 0 && RabitGetWorldSize() == 1, "queries after finalize");
    REFUSED(RabitBarrier(), RABIT_ERR_NOT_INITIALIZED);
    REFUSED(RabitFinalize(), RABIT_ERR_NOT_INITIALIZED);

    if (failures) {
        fprintf(stderr, "FAIL rank %d: %d check(s) failed\n", rank, failures);
        return 1;
    }
    printf("PASS rank %d of %d\n", rank, n);
    return 0;
}

static int init_status(int argc, char **argv)
{
    int rc = RabitInit(argc, argv);
    printf("init %d %s\n", rc, rc == RABIT_OK ? "" : RabitGetLastError());
    if (rc == RABIT_OK) {
        printf("rank %d of %d\n", RabitGetRank(), RabitGetWorldSize());
        MUST(RabitFinalize());
    }
    return 0;
}

static int lost(int argc, char **argv)
{
    MUST(RabitInit(argc, argv));
    MUST(RabitBarrier());
    if (RabitGetRank() == 1) {
        /* Leaves without RabitFinalize, as a crashed worker would. */
        printf("rank 1 leaving\n");
        fflush(stdout);
        exit(0);
    }
    float f[4] = {1, 2, 3, 4};
    int rc = RabitAllreduce(f, 4, RABIT_FLOAT, RABIT_SUM, NULL, NULL);
    printf("lost %d %s\n", rc, RabitGetLastError());
    int fin = RabitFinalize();
    printf("finalize %d\n", fin);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "--constants") == 0)
        return constants();
    if (argc >= 2 && strcmp(argv[1], "run") == 0)
        return run(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "init") == 0)
        return init_status(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "lost") == 0)
        return lost(argc, argv);
    fprintf(stderr, "usage: %s run|init|lost [DMLC_X=V ...] | --constants\n", argv[0]);
    return 2;
}
