/*
 * Memory bandwidth probe: memcpy between two arrays of SIZE bytes (default
 * 256 MiB, far beyond what stays cache-hot), split over T threads. Reports
 * bytes moved per second, counting the read and the write (2 * SIZE per
 * copy), which is the unit of the allreduce's memory traffic 2*N*S/t.
 *
 *   memcpy_bw [-t THREADS] [-s SIZE_MIB] [-n REPEATS] [-m libc|nt]
 *
 * -m libc (default): glibc's memcpy, which uses non-temporal stores only
 * above a size it derives from the cache sizes (about 181 MiB on the
 * machine of docs/benchmarks.md, so the default 256 MiB gets them, the
 * allreduce's 64 MiB would not); -m nt: a copy with SSE2 non-temporal
 * (streaming) stores for every whole line of the destination, four pages
 * at a time, and an sfence at the end, whatever the size: no output line
 * is read before it is written, the bound for a data path that streams its
 * outputs.
 *
 * Prints one line:
 * `memcpy threads T size_mib S stores M best_gbps X median_gbps Y`.
 * Build: cc -O2 -pthread -o memcpy_bw memcpy_bw.c
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

struct job {
    char *dst;
    const char *src;
    size_t len;
    int nt;
    pthread_barrier_t *start;
    /* When this thread started and ended its copy. */
    double t0, t1;
};

/* Four 16-byte non-temporal stores: one 64-byte line. */
#if defined(__x86_64__)
static void line_nt(char *d, const char *s)
{
    for (int k = 0; k < 4; k++)
        _mm_stream_si128((__m128i *)(d + 16 * k), _mm_loadu_si128((const __m128i *)(s + 16 * k)));
}
#endif

/* memcpy with non-temporal stores for the destination's whole 64-byte
 * lines (ordinary stores for a ragged head and tail), then sfence. Like
 * glibc's large-copy loop, it copies four pages at a time, a line of each
 * in turn: on the machine of docs/benchmarks.md that was 30 to 40% faster
 * than one page after another. */
static void copy_nt(char *dst, const char *src, size_t len)
{
#if defined(__x86_64__)
    enum { PAGE = 4096, WAYS = 4 };
    size_t head = (64 - (size_t)((uintptr_t)dst % 64)) % 64;
    if (head > len)
        head = len;
    memcpy(dst, src, head);
    size_t at = head;
    for (; len - at >= WAYS * PAGE; at += WAYS * PAGE)
        for (size_t l = 0; l < PAGE; l += 64)
            for (int p = 0; p < WAYS; p++)
                line_nt(dst + at + p * PAGE + l, src + at + p * PAGE + l);
    for (; len - at >= 64; at += 64)
        line_nt(dst + at, src + at);
    memcpy(dst + at, src + at, len - at);
    _mm_sfence();
#else
    memcpy(dst, src, len);
#endif
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void *worker(void *arg)
{
    struct job *j = arg;
    pthread_barrier_wait(j->start);
    j->t0 = now_s();
    if (j->nt)
        copy_nt(j->dst, j->src, j->len);
    else
        memcpy(j->dst, j->src, j->len);
    j->t1 = now_s();
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int threads = 1, repeats = 10, nt = 0;
    size_t mib = 256;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-t")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-s")) mib = (size_t)atol(argv[i + 1]);
        else if (!strcmp(argv[i], "-n")) repeats = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-m")) {
            if (!strcmp(argv[i + 1], "nt")) nt = 1;
            else if (!strcmp(argv[i + 1], "libc")) nt = 0;
            else {
                fprintf(stderr, "memcpy_bw: -m takes libc or nt\n");
                return 2;
            }
        }
    }
    if (threads < 1) threads = 1;
    if (repeats < 1) repeats = 1;
    size_t len = mib << 20;
    char *src = malloc(len), *dst = malloc(len);
    double *gbps = malloc((size_t)repeats * sizeof(double));
    if (!src || !dst || !gbps) {
        fprintf(stderr, "memcpy_bw: out of memory\n");
        return 1;
    }
    /* Touch every page so the timed copies do not measure page faults. */
    memset(src, 1, len);
    memset(dst, 2, len);
    size_t chunk = len / (size_t)threads;
    for (int r = 0; r < repeats; r++) {
        pthread_barrier_t start;
        pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
        pthread_t tid[64];
        struct job jobs[64];
        int n = threads > 64 ? 64 : threads;
        for (int t = 0; t < n; t++) {
            jobs[t] = (struct job){dst + t * chunk, src + t * chunk, chunk, nt, &start, 0, 0};
            pthread_create(&tid[t], NULL, worker, &jobs[t]);
        }
        pthread_barrier_wait(&start);
        /* From the first thread's start to the last one's end (the main
         * thread's own clock could start after a copy has ended). */
        double t0 = 1e300, t1 = 0;
        for (int t = 0; t < n; t++) {
            pthread_join(tid[t], NULL);
            t0 = jobs[t].t0 < t0 ? jobs[t].t0 : t0;
            t1 = jobs[t].t1 > t1 ? jobs[t].t1 : t1;
        }
        pthread_barrier_destroy(&start);
        gbps[r] = 2.0 * (double)chunk * n / (t1 - t0) / 1e9;
    }
    qsort(gbps, (size_t)repeats, sizeof *gbps, cmp_double);
    printf("memcpy threads %d size_mib %zu stores %s best_gbps %.3f median_gbps %.3f\n", threads, mib,
           nt ? "nt" : "libc", gbps[repeats - 1], gbps[repeats / 2]);
    free(src);
    free(dst);
    free(gbps);
    return 0;
}
