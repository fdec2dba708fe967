/*
 * Memory bandwidth probe: memcpy between two arrays of SIZE bytes (default
 * 256 MiB, far beyond what stays cache-hot), split over T threads. Reports
 * bytes moved per second, counting the read and the write (2 * SIZE per
 * copy), which is the unit of the allreduce's memory traffic 2*N*S/t.
 *
 *   memcpy_bw [-t THREADS] [-s SIZE_MIB] [-n REPEATS]
 *
 * Prints one line: `memcpy threads T size_mib S best_gbps X median_gbps Y`.
 * Build: cc -O2 -pthread -o memcpy_bw memcpy_bw.c
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct job {
    char *dst;
    const char *src;
    size_t len;
    pthread_barrier_t *start;
};

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
    memcpy(j->dst, j->src, j->len);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int threads = 1, repeats = 10;
    size_t mib = 256;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-t")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-s")) mib = (size_t)atol(argv[i + 1]);
        else if (!strcmp(argv[i], "-n")) repeats = atoi(argv[i + 1]);
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
            jobs[t] = (struct job){dst + t * chunk, src + t * chunk, chunk, &start};
            pthread_create(&tid[t], NULL, worker, &jobs[t]);
        }
        pthread_barrier_wait(&start);
        double t0 = now_s();
        for (int t = 0; t < n; t++)
            pthread_join(tid[t], NULL);
        double t1 = now_s();
        pthread_barrier_destroy(&start);
        gbps[r] = 2.0 * (double)chunk * n / (t1 - t0) / 1e9;
    }
    qsort(gbps, (size_t)repeats, sizeof *gbps, cmp_double);
    printf("memcpy threads %d size_mib %zu best_gbps %.3f median_gbps %.3f\n", threads, mib,
           gbps[repeats - 1], gbps[repeats / 2]);
    free(src);
    free(dst);
    free(gbps);
    return 0;
}
