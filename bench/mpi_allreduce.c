/*
 * Open MPI baseline for `dmlc-guest bench`: MPI_Allreduce of f32 sums over
 * the same sizes, printed in the same table (nccl-tests columns plus
 * OSU-style latency statistics and the memory-traffic bandwidth 2*N*S/t).
 * With -o sendrecv, what `dmlc-guest bench --opcode sendrecv` times: every
 * rank sends S bytes to the next rank and receives S from the previous one
 * (MPI_Sendrecv); with -o alltoall, MPI_Alltoall of S bytes per rank in N
 * equal blocks. Those two have no in-place column ("-", null in the JSON).
 *
 *   mpirun -np N ./mpi_allreduce [-o allreduce|sendrecv|alltoall]
 *                                [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS]
 *                                [-w WARMUP] [-r ROTATE_BYTES] [-j FILE]
 *
 * Time is the median over iterations as seen by rank 0. The data changes
 * between iterations: each iteration uses the next slot of a pool of buffers
 * (per direction, at least ROTATE_BYTES in all, default 2 x LLC / N capped
 * at 512 MiB, as in `dmlc-guest bench`), so large sizes are not cache-hot.
 * Inputs are small integers stored as floats, so the sum is exact whatever
 * order MPI reduces in, and #wrong compares the last iteration's result with
 * the exact sum.
 *
 * Build: mpicc -O2 -o mpi_allreduce mpi_allreduce.c
 */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static size_t parse_size(const char *s)
{
    char *end;
    double v = strtod(s, &end);
    switch (*end) {
    case 'k': case 'K': v *= 1024.0; break;
    case 'm': case 'M': v *= 1024.0 * 1024.0; break;
    case 'g': case 'G': v *= 1024.0 * 1024.0 * 1024.0; break;
    default: break;
    }
    return (size_t)v;
}

/* Largest cache size the kernel reports for cpu0, or 32 MiB. */
static size_t llc_bytes(void)
{
    size_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[128];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        char buf[64] = {0};
        if (fgets(buf, sizeof buf, f)) {
            size_t v = parse_size(buf);
            if (v > best)
                best = v;
        }
        fclose(f);
    }
    return best ? best : (size_t)32 << 20;
}

enum kind { ALLREDUCE, SENDRECV, ALLTOALL };

static const char *const kind_name[] = {"allreduce", "sendrecv", "alltoall"};

/* Element p (position in the pool) of rank r's input: an exact small integer. */
static float input_value(int r, size_t p)
{
    return (float)((int)((p * 31u + (size_t)r * 17u) % 257u) - 128);
}

static float sum_value(int world, size_t p)
{
    float s = 0.0f;
    for (int r = 0; r < world; r++)
        s += input_value(r, p);
    return s;
}

/* Element i of rank `rank`'s output of the collective whose input starts
 * at pool position `base`; `count` elements per rank (per block for
 * all-to-all). */
static float expected_value(enum kind k, int world, int rank, size_t count, size_t base,
                            size_t i)
{
    switch (k) {
    case SENDRECV:
        return input_value((rank + world - 1) % world, base + i);
    case ALLTOALL:
        /* Block s comes from rank s: its block `rank`. */
        return input_value((int)(i / count), base + (size_t)rank * count + i % count);
    default:
        return sum_value(world, base + i);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

struct stats {
    double median, avg, min, max, p99;
};

static struct stats summarize(double *t, int n)
{
    struct stats s = {0};
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    s.min = t[0];
    s.max = t[n - 1];
    s.median = (n % 2) ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2.0;
    int idx = (int)((99 * n + 99) / 100) - 1; /* ceil(0.99 n) - 1 */
    s.p99 = t[idx < 0 ? 0 : idx];
    for (int i = 0; i < n; i++)
        s.avg += t[i];
    s.avg /= n;
    return s;
}

/* Runs ITERS timed iterations (after WARMUP) and returns the stats; every
 * rank runs the same loop. Slot s of a pool starts at element s * stride.
 * in_place selects MPI_IN_PLACE on the out pool (allreduce only). */
static struct stats run(enum kind k, float *in, float *out, size_t count, size_t stride,
                        size_t slots, int iters, int warmup, int in_place, double *times)
{
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    for (int i = -warmup; i < iters; i++) {
        size_t slot = (size_t)(i + warmup) % slots;
        const void *src = in_place ? MPI_IN_PLACE : (const void *)(in + slot * stride);
        float *dst = out + slot * stride;
        double t0 = now_us();
        switch (k) {
        case SENDRECV:
            MPI_Sendrecv(src, (int)count, MPI_FLOAT, (rank + 1) % world, 0, dst, (int)count,
                         MPI_FLOAT, (rank + world - 1) % world, 0, MPI_COMM_WORLD,
                         MPI_STATUS_IGNORE);
            break;
        case ALLTOALL:
            MPI_Alltoall(src, (int)count, MPI_FLOAT, dst, (int)count, MPI_FLOAT, MPI_COMM_WORLD);
            break;
        default:
            MPI_Allreduce(src, dst, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        }
        double t1 = now_us();
        if (i >= 0)
            times[i] = t1 - t0;
    }
    return summarize(times, iters);
}

/* Wrong elements of an output of `elems` elements. */
static long check(enum kind k, const float *out, size_t elems, size_t count, size_t base,
                  int world, int rank)
{
    long wrong = 0;
    for (size_t i = 0; i < elems; i++)
        if (out[i] != expected_value(k, world, rank, count, base, i))
            wrong++;
    return wrong;
}

int main(int argc, char **argv)
{
    size_t minb = 4, maxb = (size_t)64 << 20, rotate = 0;
    double factor = 2.0;
    int iters = 20, warmup = 5;
    enum kind kind = ALLREDUCE;
    const char *json = NULL;

    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            if (rank == 0)
                fprintf(stderr, "usage: %s [-o allreduce|sendrecv|alltoall] [-b MIN] [-e MAX] "
                                "[-f FACTOR] [-n ITERS] [-w WARMUP] [-r ROTATE_BYTES] [-j JSON]\n",
                        argv[0]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        if (!strcmp(a, "-o")) {
            int known = 0;
            for (int k = ALLREDUCE; k <= ALLTOALL; k++)
                if (!strcmp(v, kind_name[k])) {
                    kind = (enum kind)k;
                    known = 1;
                }
            if (!known) {
                if (rank == 0)
                    fprintf(stderr, "-o %s: not allreduce, sendrecv or alltoall\n", v);
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
        } else if (!strcmp(a, "-b")) minb = parse_size(v);
        else if (!strcmp(a, "-e")) maxb = parse_size(v);
        else if (!strcmp(a, "-f")) factor = strtod(v, NULL);
        else if (!strcmp(a, "-n")) iters = atoi(v);
        else if (!strcmp(a, "-w")) warmup = atoi(v);
        else if (!strcmp(a, "-r")) rotate = parse_size(v);
        else if (!strcmp(a, "-j")) json = v;
        else {
            if (rank == 0)
                fprintf(stderr, "unknown option %s\n", a);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        i++;
    }
    if (minb < 4) minb = 4;
    if (iters < 1) iters = 1;
    if (factor <= 1.0) factor = 2.0;
    if (rotate == 0) {
        rotate = 2 * llc_bytes() / (size_t)world;
        if (rotate > ((size_t)512 << 20))
            rotate = (size_t)512 << 20;
    }
    size_t pool = rotate > maxb ? rotate : maxb;
    size_t pool_elems = pool / 4;
    float *in = malloc(pool_elems * sizeof(float));
    float *out = malloc(pool_elems * sizeof(float));
    double *times = malloc((size_t)iters * sizeof(double));
    if (!in || !out || !times) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t p = 0; p < pool_elems; p++) {
        in[p] = input_value(rank, p);
        out[p] = 0.0f;
    }

    FILE *js = NULL;
    if (rank == 0) {
        static const char *const call[] = {"MPI_Allreduce", "MPI_Sendrecv to the next rank",
                                           "MPI_Alltoall"};
        printf("# mpi_allreduce: %s, Open MPI, N %d\n", call[kind], world);
        printf("# dtype f32, op %s, iters %d, warmup %d, data rotated over %zu MiB per direction\n",
               kind == ALLREDUCE ? "sum" : "none", iters, warmup, pool >> 20);
        printf("#%71s%40s\n", "out-of-place", "in-place");
        printf("#%11s %12s %6s %6s %5s %9s %8s %8s %7s %9s %8s %8s %7s %9s %9s %9s %9s %8s\n",
               "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
               "time", "algbw", "busbw", "#wrong", "avg", "min", "max", "p99", "membw");
        printf("#%11s %12s %6s %6s %5s %9s %8s %8s %7s %9s %8s %8s %7s %9s %9s %9s %9s %8s\n",
               "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
               "(GB/s)", "", "(us)", "(us)", "(us)", "(us)", "(GB/s)");
        if (json) {
            js = fopen(json, "w");
            if (!js) {
                perror(json);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
            fprintf(js, "{\"tool\": \"mpi_allreduce\", \"transport\": \"open-mpi\", \"mode\": \"mpi\", "
                        "\"world\": %d, \"opcode\": \"%s\", \"dtype\": \"f32\", \"op\": \"%s\", "
                        "\"iters\": %d, \"warmup\": %d, \"results\": [",
                    world, kind_name[kind], kind == ALLREDUCE ? "sum" : "none", iters, warmup);
        }
    }

    int first = 1;
    for (size_t size = minb; size <= maxb;) {
        /* Elements per rank (per block for all-to-all), and per slot. */
        size_t count = kind == ALLTOALL ? size / 4 / (size_t)world : size / 4;
        size_t stride = kind == ALLTOALL ? count * (size_t)world : count;
        if (count == 0)
            goto next;
        size_t slots = pool_elems / stride;
        if (slots < 1) slots = 1;
        if (slots > (size_t)iters + (size_t)warmup) slots = (size_t)iters + (size_t)warmup;

        MPI_Barrier(MPI_COMM_WORLD);
        struct stats oop = run(kind, in, out, count, stride, slots, iters, warmup, 0, times);
        size_t last = (size_t)(iters + warmup - 1) % slots;
        long wrong_oop = check(kind, out + last * stride, stride, count, last * stride, world,
                               rank);

        struct stats ip = {0};
        long wrong_ip = 0;
        if (kind == ALLREDUCE) {
            MPI_Barrier(MPI_COMM_WORLD);
            ip = run(kind, in, out, count, stride, slots, iters, warmup, 1, times);
            /* Check in place on fresh data: refill slot 0 with this rank's input. */
            for (size_t i = 0; i < count; i++)
                out[i] = input_value(rank, i);
            MPI_Allreduce(MPI_IN_PLACE, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            wrong_ip = check(kind, out, count, count, 0, world, rank);
        }

        long wrong[2] = {wrong_oop, wrong_ip}, total[2];
        MPI_Reduce(wrong, total, 2, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            /* nccl-tests' size: a rank's buffer. */
            double bytes = (double)stride * 4.0;
            double bus = kind == ALLREDUCE ? 2.0 * (world - 1) / world
                         : kind == ALLTOALL ? (double)(world - 1) / world : 1.0;
            double alg_o = bytes / oop.median / 1e3;
            double mem = 2.0 * world * bytes / oop.median / 1e3;
            char ipcols[64];
            if (kind == ALLREDUCE) {
                double alg_i = bytes / ip.median / 1e3;
                snprintf(ipcols, sizeof ipcols, "%9.2f %8.3f %8.3f %7ld", ip.median, alg_i,
                         alg_i * bus, total[1]);
            } else {
                snprintf(ipcols, sizeof ipcols, "%9s %8s %8s %7s", "-", "-", "-", "-");
            }
            printf(" %11zu %12zu %6s %6s %5d %9.2f %8.3f %8.3f %7ld %s %9.2f %9.2f %9.2f %9.2f %8.3f\n",
                   stride * 4, count, "f32", kind == ALLREDUCE ? "sum" : "none", -1, oop.median,
                   alg_o, alg_o * bus, total[0], ipcols, oop.avg, oop.min, oop.max, oop.p99, mem);
            fflush(stdout);
            if (js) {
                fprintf(js,
                        "%s\n {\"size\": %zu, \"count\": %zu, "
                        "\"oop\": {\"time_us\": %.3f, \"algbw\": %.4f, \"busbw\": %.4f, \"wrong\": %ld, "
                        "\"avg_us\": %.3f, \"min_us\": %.3f, \"max_us\": %.3f, \"p99_us\": %.3f, "
                        "\"membw\": %.4f}, ",
                        first ? "" : ",", stride * 4, count, oop.median, alg_o, alg_o * bus,
                        total[0], oop.avg, oop.min, oop.max, oop.p99, mem);
                if (kind == ALLREDUCE) {
                    double alg_i = bytes / ip.median / 1e3;
                    fprintf(js,
                            "\"ip\": {\"time_us\": %.3f, \"algbw\": %.4f, \"busbw\": %.4f, "
                            "\"wrong\": %ld}}",
                            ip.median, alg_i, alg_i * bus, total[1]);
                } else {
                    fprintf(js, "\"ip\": null}");
                }
            }
        }
        first = 0;
next:;
        size_t next = (size_t)((double)size * factor);
        size = next > size ? next : size + 4;
        size = (size + 3) / 4 * 4;
    }
    if (js) {
        fprintf(js, "\n]}\n");
        fclose(js);
    }
    free(in);
    free(out);
    free(times);
    MPI_Finalize();
    return 0;
}
