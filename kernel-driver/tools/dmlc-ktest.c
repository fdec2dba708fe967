// SPDX-License-Identifier: GPL-2.0-only
/*
 * dmlc-ktest: exercise /dev/dmlcN (the virtio_dmlc kernel driver) with
 * buffers from plain malloc, straight through the ioctl ABI.
 *
 *   dmlc-ktest [--dev PATH] info
 *   dmlc-ktest [--dev PATH] selftest [--quick]   (with feature bits 1 to 3:
 *                                                 their ABI fields too)
 *   dmlc-ktest [--dev PATH] bench [--iters N] [--spin-us US]
 *   dmlc-ktest [--dev PATH] hold
 *
 * Every rank computes the expected result of each collective itself, from
 * the inputs every rank derives from its own rank: no check goes through
 * the device under test.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "../include/uapi/virtio_dmlc.h"

enum { ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, REDUCE_SCATTER, BARRIER, NOP,
	SEND, RECV, ALLTOALL, ALLTOALLV, GATHER, GATHERV, SCATTER, SCATTERV,
	COMM_SPLIT, COMM_CREATE, COMM_FREE };
enum { F32 = 0 };
enum { SUM = 0, MAX = 3 };
enum { STATUS_BAD_REQUEST = 1, BAD_COMM = 14 };
static const char *const status_name[] = {
	"ok", "bad_request", "mismatch", "peer_lost", "timeout",
	"unsupported", "too_big", "reset", "truncate",
};

/*
 * The sizes of the first version of the ABI's structs, before the fields
 * of feature bit 1: what binaries built against it pass as argsz.
 */
#define V1_INFO		offsetof(struct dmlc_info, max_comms)
#define V1_SUBMIT	offsetof(struct dmlc_submit, comm)
#define V1_WAIT		offsetof(struct dmlc_wait, reply)
static_assert(V1_INFO == 104 && V1_SUBMIT == 136 && V1_WAIT == 72,
	      "the first version's struct sizes");

static int fd = -1;
static struct dmlc_info info;
static unsigned int checks;
static uint32_t spin_us = 1000000;	/* 1 s: in effect, poll */

static void die(const char *fmt, const char *what)
{
	fprintf(stderr, "dmlc-ktest: ");
	fprintf(stderr, fmt, what);
	fprintf(stderr, "\n");
	exit(1);
}

static double now_us(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void get_info(void)
{
	memset(&info, 0, sizeof(info));
	info.argsz = sizeof(info);
	if (ioctl(fd, DMLC_IOC_INFO, &info))
		die("DMLC_IOC_INFO: %s", strerror(errno));
}

static const char *outcome(const struct dmlc_completion *c)
{
	static char buf[96];

	if (c->error)
		snprintf(buf, sizeof(buf), "driver error %s", strerror(-c->error));
	else
		snprintf(buf, sizeof(buf), "status %s detail %u peer %d",
			 c->status < 9 ? status_name[c->status] : "?", c->detail,
			 (int)c->peer);
	return buf;
}

/* One collective; float buffers (or none). Returns the completion. */
static struct dmlc_completion run(uint16_t opcode, uint8_t op, uint32_t root,
				  uint64_t count, const void *in, size_t in_len,
				  void *out, size_t out_len, uint32_t flags)
{
	struct dmlc_iovec iv = { (uintptr_t)in, in_len };
	struct dmlc_iovec ov = { (uintptr_t)out, out_len };
	struct dmlc_submit s = {
		.argsz = sizeof(s),
		.flags = flags | DMLC_SUBMIT_WAIT,
		.opcode = opcode, .dtype = F32, .op = op, .root = root,
		.count = count, .timeout_ms = 60000,
		.in_iov = (uintptr_t)&iv, .in_cnt = in_len ? 1 : 0,
		.out_iov = (uintptr_t)&ov, .out_cnt = out_len ? 1 : 0,
		.spin_us = spin_us,
	};

	if (ioctl(fd, DMLC_IOC_SUBMIT, &s))
		die("DMLC_IOC_SUBMIT: %s", strerror(errno));
	return s.done;
}

/* Submits s (argsz, fields and buffers set) and waits for it. */
static void submit_wait(struct dmlc_submit *s)
{
	s->flags |= DMLC_SUBMIT_WAIT;
	s->spin_us = spin_us;
	if (!s->timeout_ms)
		s->timeout_ms = 60000;
	if (ioctl(fd, DMLC_IOC_SUBMIT, s))
		die("DMLC_IOC_SUBMIT: %s", strerror(errno));
}

static void expect_ok(const char *what, const struct dmlc_completion *c)
{
	if (!c->error && !c->status)
		return;
	fprintf(stderr, "dmlc-ktest: rank %u: %s: %s\n", info.rank, what, outcome(c));
	exit(1);
}

/* Rank r's input element i: small integers, so every sum is exact. */
static float input(uint32_t r, uint64_t i)
{
	return (float)((r + 1) * (i % 97 + 1));
}

static void fill(float *p, uint32_t r, uint64_t base, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++)
		p[i] = input(r, base + i);
}

static void check(const char *what, const float *got, uint64_t n,
		  float (*want)(uint64_t i, void *ctx), void *ctx)
{
	for (uint64_t i = 0; i < n; i++) {
		float w = want(i, ctx);

		if (got[i] != w) {
			fprintf(stderr, "dmlc-ktest: rank %u: %s: element %llu is %g, want %g\n",
				info.rank, what, (unsigned long long)i, got[i], w);
			exit(1);
		}
	}
	checks++;
}

static float want_sum(uint64_t i, void *ctx)
{
	uint64_t base = ctx ? *(uint64_t *)ctx : 0;
	float s = 0;

	for (uint32_t r = 0; r < info.world_size; r++)
		s += input(r, base + i);
	return s;
}

static float want_max(uint64_t i, void *ctx)
{
	(void)ctx;
	return input(info.world_size - 1, i);
}

static float want_root(uint64_t i, void *ctx)
{
	return input(*(uint32_t *)ctx, i);
}

/* Allgather output: block r holds rank r's input. */
static uint64_t gather_count;
static float want_gather(uint64_t i, void *ctx)
{
	(void)ctx;
	return input(i / gather_count, i % gather_count);
}

/*
 * Buffers from malloc, deliberately 4 bytes past an aligned address, so
 * that they straddle pages unevenly.
 */
static float *alloc_f32(uint64_t n)
{
	char *p = malloc(n * 4 + 64);

	if (!p)
		die("out of memory (%s)", "malloc");
	return (float *)(p + 4);
}

static void free_f32(float *p)
{
	free((char *)p - 4);
}

/* Retries a barrier until the whole group is here (members may still be joining). */
static void sync_group(void)
{
	for (int tries = 0; tries < 60; tries++) {
		struct dmlc_completion c = run(BARRIER, 0, 0, 0, NULL, 0, NULL, 0, 0);

		if (!c.error && !c.status)
			return;
		fprintf(stderr, "dmlc-ktest: rank %u: sync barrier: %s, again\n",
			info.rank, outcome(&c));
		sleep(1);
	}
	die("the group never got together (%s)", "60 barriers failed");
}

static void test_allreduce(uint64_t n, int in_place)
{
	float *in = alloc_f32(n), *out = alloc_f32(n);
	struct dmlc_completion c;
	char what[80];

	snprintf(what, sizeof(what), "allreduce of %llu f32%s",
		 (unsigned long long)n, in_place ? " in place" : "");
	fill(in_place ? out : in, info.rank, 0, n);
	if (in_place)
		c = run(ALLREDUCE, SUM, 0, n, NULL, 0, out, n * 4, DMLC_SUBMIT_IN_PLACE);
	else
		c = run(ALLREDUCE, SUM, 0, n, in, n * 4, out, n * 4, 0);
	expect_ok(what, &c);
	check(what, out, n, want_sum, NULL);
	if (!in_place) {
		fill(out, info.rank, 0, n);	/* the input is unchanged */
		if (memcmp(in, out, n * 4))
			die("%s changed its input", what);
	}
	printf("rank %u: %s ok (%u device requests)\n", info.rank, what, c.requests);
	free_f32(in);
	free_f32(out);
}

static void test_others(uint64_t n)
{
	uint32_t w = info.world_size, root = w - 1;
	float *in = alloc_f32(n * w), *out = alloc_f32(n * w);
	struct dmlc_completion c;

	/* broadcast from the last rank */
	fill(in, info.rank, 0, n);
	c = run(BROADCAST, 0, root, n, info.rank == root ? in : NULL,
		info.rank == root ? n * 4 : 0, out, n * 4, 0);
	expect_ok("broadcast", &c);
	check("broadcast", out, n, want_root, &root);
	printf("rank %u: broadcast of %llu f32 ok (%u device requests)\n", info.rank,
	       (unsigned long long)n, c.requests);

	/* allgather */
	c = run(ALLGATHER, 0, 0, n, in, n * 4, out, n * w * 4, 0);
	expect_ok("allgather", &c);
	gather_count = n;
	check("allgather", out, n * w, want_gather, NULL);
	printf("rank %u: allgather of %llu f32 ok (%u device requests)\n", info.rank,
	       (unsigned long long)n, c.requests);

	/* reduce-scatter: this rank gets the sums of block rank */
	fill(in, info.rank, 0, n * w);
	c = run(REDUCE_SCATTER, SUM, 0, n, in, n * w * 4, out, n * 4, 0);
	expect_ok("reduce_scatter", &c);
	{
		uint64_t base = (uint64_t)info.rank * n;

		check("reduce_scatter", out, n, want_sum, &base);
	}
	printf("rank %u: reduce_scatter of %llu f32 ok (%u device requests)\n",
	       info.rank, (unsigned long long)n, c.requests);

	/* reduce (max) to rank 0 */
	c = run(REDUCE, MAX, 0, 1000, in, 4000, info.rank == 0 ? out : NULL,
		info.rank == 0 ? 4000 : 0, 0);
	expect_ok("reduce", &c);
	if (info.rank == 0)
		check("reduce max", out, 1000, want_max, NULL);
	free_f32(in);
	free_f32(out);
}

/* Four allreduces in flight at once, reaped through poll() and read(). */
static void test_async(void)
{
	enum { N = 4, COUNT = 5000 };
	float *in[N], *out[N];
	struct dmlc_iovec iv[N], ov[N];
	int seen[N] = { 0 };

	for (int k = 0; k < N; k++) {
		struct dmlc_submit s = { .argsz = sizeof(s), .opcode = ALLREDUCE,
			.dtype = F32, .op = SUM, .count = COUNT, .timeout_ms = 60000,
			.in_cnt = 1, .out_cnt = 1, .user_data = k };

		in[k] = alloc_f32(COUNT);
		out[k] = alloc_f32(COUNT);
		fill(in[k], info.rank, 0, COUNT);
		iv[k] = (struct dmlc_iovec){ (uintptr_t)in[k], COUNT * 4 };
		ov[k] = (struct dmlc_iovec){ (uintptr_t)out[k], COUNT * 4 };
		s.in_iov = (uintptr_t)&iv[k];
		s.out_iov = (uintptr_t)&ov[k];
		if (ioctl(fd, DMLC_IOC_SUBMIT, &s))
			die("async DMLC_IOC_SUBMIT: %s", strerror(errno));
	}
	for (int got = 0; got < N;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		struct dmlc_completion c[N];
		ssize_t r;

		if (poll(&p, 1, 60000) != 1)
			die("poll: no completion in 60 s (%s)", "async");
		r = read(fd, c, sizeof(c));
		if (r <= 0 || r % sizeof(c[0]))
			die("read: %s", r < 0 ? strerror(errno) : "short record");
		for (int j = 0; j < r / (ssize_t)sizeof(c[0]); j++) {
			uint64_t k = c[j].user_data;

			if (k >= N || seen[k]++)
				die("read: unknown or repeated completion (%s)", "user_data");
			expect_ok("async allreduce", &c[j]);
			check("async allreduce", out[k], COUNT, want_sum, NULL);
			got++;
		}
	}
	for (int k = 0; k < N; k++) {
		free_f32(in[k]);
		free_f32(out[k]);
	}
	printf("rank %u: 4 allreduces in flight, reaped with poll and read: ok\n", info.rank);
}

/* Requests the driver must refuse before the device sees them. */
static void test_refusals(void)
{
	float *buf = alloc_f32(16);
	struct dmlc_iovec v = { (uintptr_t)buf + 2, 32 };	/* not f32-aligned */
	struct dmlc_submit s = { .argsz = sizeof(s), .opcode = ALLREDUCE,
		.dtype = F32, .count = 8, .in_iov = (uintptr_t)&v, .in_cnt = 1,
		.out_iov = (uintptr_t)&v, .out_cnt = 1 };

	if (ioctl(fd, DMLC_IOC_SUBMIT, &s) == 0 || errno != EINVAL)
		die("a misaligned buffer was not refused with EINVAL (%s)", strerror(errno));
	s.flags = 1u << 7;
	if (ioctl(fd, DMLC_IOC_SUBMIT, &s) == 0 || errno != EINVAL)
		die("an unknown flag was not refused with EINVAL (%s)", strerror(errno));
	s.argsz = 8;
	if (ioctl(fd, DMLC_IOC_SUBMIT, &s) == 0 || errno != EINVAL)
		die("a short argsz was not refused with EINVAL (%s)", strerror(errno));
	free_f32(buf);
	checks += 3;
}

/* True if bytes [from, size) of p still hold the 0xa5 they were set to. */
static int tail_intact(const void *p, size_t from, size_t size)
{
	const unsigned char *b = p;

	for (size_t i = from; i < size; i++)
		if (b[i] != 0xa5)
			return 0;
	return 1;
}

/*
 * A caller built against the first version of the ABI still works: the
 * structs end before the fields of feature bit 1, and the bytes after
 * them (0xa5 here) are neither read (they would name communicator
 * 0xa5a5a5a5 and a table far too large) nor written.
 */
static void test_old_argsz(void)
{
	enum { COUNT = 300 };
	float *in = alloc_f32(COUNT), *out = alloc_f32(COUNT);
	struct dmlc_iovec iv = { (uintptr_t)in, COUNT * 4 }, ov = { (uintptr_t)out, COUNT * 4 };
	struct dmlc_info oi;
	struct dmlc_submit s;
	struct dmlc_wait w;

	memset(&oi, 0xa5, sizeof(oi));
	memset(&oi, 0, V1_INFO);
	oi.argsz = V1_INFO;
	if (ioctl(fd, DMLC_IOC_INFO, &oi))
		die("DMLC_IOC_INFO of the first version's size: %s", strerror(errno));
	if (!tail_intact(&oi, V1_INFO, sizeof(oi)) || oi.rank != info.rank ||
	    oi.world_size != info.world_size)
		die("DMLC_IOC_INFO of the first version's size: %s",
		    "wrong answer, or bytes written past argsz");
	checks++;

	/* A waiting submit of the first version's size ... */
	fill(in, info.rank, 0, COUNT);
	memset(&s, 0xa5, sizeof(s));
	memset(&s, 0, V1_SUBMIT);
	s.argsz = V1_SUBMIT;
	s.opcode = ALLREDUCE;
	s.dtype = F32;
	s.op = SUM;
	s.count = COUNT;
	s.in_iov = (uintptr_t)&iv;
	s.in_cnt = 1;
	s.out_iov = (uintptr_t)&ov;
	s.out_cnt = 1;
	submit_wait(&s);
	if (!tail_intact(&s, V1_SUBMIT, sizeof(s)))
		die("a submit of the first version's size: %s", "bytes written past argsz");
	expect_ok("allreduce with the first version's argsz", &s.done);
	check("allreduce with the first version's argsz", out, COUNT, want_sum, NULL);

	/* ... and one reaped by a DMLC_IOC_WAIT of the first version's size. */
	memset(out, 0, COUNT * 4);
	s.flags = 0;
	s.id = 0;
	if (ioctl(fd, DMLC_IOC_SUBMIT, &s) || !s.id)
		die("DMLC_IOC_SUBMIT of the first version's size: %s", strerror(errno));
	memset(&w, 0xa5, sizeof(w));
	memset(&w, 0, V1_WAIT);
	w.argsz = V1_WAIT;
	w.id = s.id;
	w.timeout_ms = 60000;
	w.spin_us = spin_us;
	if (ioctl(fd, DMLC_IOC_WAIT, &w))
		die("DMLC_IOC_WAIT of the first version's size: %s", strerror(errno));
	if (!tail_intact(&w, V1_WAIT, sizeof(w)) || !tail_intact(&s, V1_SUBMIT, sizeof(s)))
		die("a wait of the first version's size: %s", "bytes written past argsz");
	expect_ok("allreduce reaped with the first version's argsz", &w.done);
	check("allreduce reaped with the first version's argsz", out, COUNT, want_sum, NULL);
	free_f32(in);
	free_f32(out);
	printf("rank %u: callers of the first ABI version (argsz %zu, %zu, %zu): ok\n",
	       info.rank, V1_INFO, V1_SUBMIT, V1_WAIT);
}

/* A receive's element i: rank 0's message, then what was there before. */
static float want_received(uint64_t i, void *ctx)
{
	uint64_t len = *(uint64_t *)ctx;

	return i < len ? input(0, i) : -1.0f;
}

/*
 * Rank 0 sends 40 f32 to rank 1, which receives them from any source into
 * room for 50 (200 bytes: a buffer the driver copies rather than pins):
 * the reply names the length and the sender, and the rest of the room
 * keeps what it held.
 */
static void test_send_recv(void)
{
	enum { LEN = 40, ROOM = 50 };
	float *buf = alloc_f32(ROOM);
	struct dmlc_iovec v = { (uintptr_t)buf, 0 };
	struct dmlc_submit s = { .argsz = sizeof(s), .dtype = F32, .tag = 7 };
	uint64_t len = LEN;

	if (info.rank > 1)
		goto out;
	if (info.rank == 0) {
		fill(buf, 0, 0, LEN);
		v.len = LEN * 4;
		s.opcode = SEND;
		s.peer = 1;
		s.count = LEN;
		s.in_iov = (uintptr_t)&v;
		s.in_cnt = 1;
	} else {
		for (int i = 0; i < ROOM; i++)
			buf[i] = -1.0f;
		v.len = ROOM * 4;
		s.opcode = RECV;
		s.peer = DMLC_ANY_SOURCE;
		s.count = ROOM;
		s.out_iov = (uintptr_t)&v;
		s.out_cnt = 1;
	}
	submit_wait(&s);
	expect_ok(info.rank ? "receive" : "send", &s.done);
	/* Both ends learn the length; the receive also its sender. */
	if (s.reply.length != LEN * 4 ||
	    (info.rank && (s.done.peer != 0 || s.reply.peer_world != 0))) {
		fprintf(stderr, "dmlc-ktest: rank %u: length %llu peer %u/%u, want %u (and 0/0)\n",
			info.rank, (unsigned long long)s.reply.length, s.done.peer,
			s.reply.peer_world, LEN * 4);
		exit(1);
	}
	if (info.rank) {
		check("receive from any source", buf, ROOM, want_received, &len);
		printf("rank 1: received %u bytes from any source (rank 0), room %u: ok\n",
		       LEN * 4, ROOM * 4);
	} else {
		checks++;
		printf("rank 0: sent %u bytes to rank 1: ok\n", LEN * 4);
	}
out:
	free_f32(buf);
}

/*
 * The fields of feature bit 1 on the raw ABI. Without the bit (module
 * parameter comm=0) neither bit 2 nor 3 is negotiated, and a request
 * that sets one of the fields is refused with EOPNOTSUPP. With it: a
 * comm_split that reverses the ranks, reaped by DMLC_IOC_WAIT with its
 * reply; an allreduce on the new communicator; its comm_free, after
 * which the device refuses the id (BAD_COMM); a table over 16 bytes a
 * rank (EINVAL); a send and a receive from any source.
 */
static void test_comm_fields(void)
{
	uint32_t w = info.world_size, key = w - 1 - info.rank, comm;
	struct dmlc_submit s = { .argsz = sizeof(s), .opcode = BARRIER };
	struct dmlc_wait wt = { .argsz = sizeof(wt), .timeout_ms = 60000 };
	float *in = alloc_f32(100), *out = alloc_f32(100);
	struct dmlc_iovec iv = { (uintptr_t)in, 400 }, ov = { (uintptr_t)out, 400 };
	uint64_t table[4] = { 0 };

	if (!(info.features & (1ull << DMLC_F_COMM))) {
		/* spec DRV-COMM-1: bits 2 and 3 never without bit 1 */
		if (info.features & (1ull << DMLC_F_P2P | 1ull << DMLC_F_BLOCKS))
			die("feature bit 2 or 3 negotiated without bit 1 (%s)", "DRV-COMM-1");
		s.comm = 1;
		if (ioctl(fd, DMLC_IOC_SUBMIT, &s) == 0 || errno != EOPNOTSUPP)
			die("a comm without feature bit 1 was not refused with EOPNOTSUPP (%s)",
			    strerror(errno));
		s.comm = 0;
		s.key = 1;
		if (ioctl(fd, DMLC_IOC_SUBMIT, &s) == 0 || errno != EOPNOTSUPP)
			die("a key without feature bit 1 was not refused with EOPNOTSUPP (%s)",
			    strerror(errno));
		checks += 3;
		printf("rank %u: no feature bit 1 (%#llx): comm fields refused (EOPNOTSUPP): ok\n",
		       info.rank, (unsigned long long)info.features);
		goto out;
	}
	s.table = (uintptr_t)table;
	s.table_bytes = 16 * w + 1;
	if (ioctl(fd, DMLC_IOC_SUBMIT, &s) == 0 || errno != EINVAL)
		die("a table over 16 bytes a rank was not refused with EINVAL (%s)",
		    strerror(errno));
	checks++;

	/* comm_split: one color, keys in reverse, reaped with DMLC_IOC_WAIT */
	s = (struct dmlc_submit){ .argsz = sizeof(s), .opcode = COMM_SPLIT, .peer = 0,
		.key = key, .timeout_ms = 60000 };
	if (ioctl(fd, DMLC_IOC_SUBMIT, &s))
		die("comm_split: DMLC_IOC_SUBMIT: %s", strerror(errno));
	wt.id = s.id;
	wt.spin_us = spin_us;
	if (ioctl(fd, DMLC_IOC_WAIT, &wt))
		die("comm_split: DMLC_IOC_WAIT: %s", strerror(errno));
	expect_ok("comm_split", &wt.done);
	comm = wt.reply.comm;
	if (!comm || wt.reply.comm_rank != key || wt.reply.comm_size != w) {
		fprintf(stderr, "dmlc-ktest: rank %u: comm_split: %u, %u of %u, want %u of %u\n",
			info.rank, comm, wt.reply.comm_rank, wt.reply.comm_size, key, w);
		exit(1);
	}
	checks++;

	/* an allreduce on it: the sum does not depend on the order */
	fill(in, info.rank, 0, 100);
	s = (struct dmlc_submit){ .argsz = sizeof(s), .opcode = ALLREDUCE, .dtype = F32,
		.op = SUM, .count = 100, .comm = comm, .in_iov = (uintptr_t)&iv,
		.in_cnt = 1, .out_iov = (uintptr_t)&ov, .out_cnt = 1 };
	submit_wait(&s);
	expect_ok("allreduce on the split communicator", &s.done);
	check("allreduce on the split communicator", out, 100, want_sum, NULL);

	/* comm_free, then the id is unknown */
	s = (struct dmlc_submit){ .argsz = sizeof(s), .opcode = COMM_FREE, .comm = comm };
	submit_wait(&s);
	expect_ok("comm_free", &s.done);
	s = (struct dmlc_submit){ .argsz = sizeof(s), .opcode = BARRIER, .comm = comm };
	submit_wait(&s);
	if (s.done.error || s.done.status != STATUS_BAD_REQUEST || s.done.detail != BAD_COMM) {
		fprintf(stderr, "dmlc-ktest: rank %u: barrier on freed comm %u: %s, want %u\n",
			info.rank, comm, outcome(&s.done), BAD_COMM);
		exit(1);
	}
	checks++;
	printf("rank %u: comm_split: comm %u rank %u of %u, allreduce, comm_free: ok\n",
	       info.rank, comm, key, w);
	if (w > 1 && (info.features & (1ull << DMLC_F_P2P)))
		test_send_recv();
out:
	free_f32(in);
	free_f32(out);
}

/* Alltoall output: block j holds block rank of rank j's input. */
static uint64_t block_count;
static float want_alltoall(uint64_t i, void *ctx)
{
	(void)ctx;
	return input(i / block_count, info.rank * block_count + i % block_count);
}

/* Scatter output: block rank of the root's input. */
static float want_scattered(uint64_t i, void *ctx)
{
	return input(*(uint32_t *)ctx, info.rank * block_count + i);
}

/*
 * All-to-all, gather (to the last rank) and scatter (from rank 0) of n
 * f32 a block on communicator 0, which the driver splits into device
 * requests like the other collectives.
 */
static void test_blocks(uint64_t n)
{
	uint32_t w = info.world_size, last = w - 1, first = 0;
	float *in = alloc_f32(n * w), *out = alloc_f32(n * w);
	struct dmlc_iovec iv = { (uintptr_t)in, 0 }, ov = { (uintptr_t)out, 0 };
	struct dmlc_submit s;

	block_count = n;
	fill(in, info.rank, 0, n * w);
	iv.len = n * w * 4;
	ov.len = n * w * 4;
	s = (struct dmlc_submit){ .argsz = sizeof(s), .opcode = ALLTOALL, .dtype = F32,
		.count = n, .in_iov = (uintptr_t)&iv, .in_cnt = 1,
		.out_iov = (uintptr_t)&ov, .out_cnt = 1 };
	submit_wait(&s);
	expect_ok("alltoall", &s.done);
	check("alltoall", out, n * w, want_alltoall, NULL);
	printf("rank %u: alltoall of %llu f32 ok (%u device requests)\n", info.rank,
	       (unsigned long long)n, s.done.requests);

	iv.len = n * 4;
	s = (struct dmlc_submit){ .argsz = sizeof(s), .opcode = GATHER, .dtype = F32,
		.root = last, .count = n, .in_iov = (uintptr_t)&iv, .in_cnt = 1,
		.out_iov = (uintptr_t)&ov, .out_cnt = info.rank == last };
	submit_wait(&s);
	expect_ok("gather", &s.done);
	gather_count = n;
	if (info.rank == last)
		check("gather", out, n * w, want_gather, NULL);
	printf("rank %u: gather of %llu f32 ok (%u device requests)\n", info.rank,
	       (unsigned long long)n, s.done.requests);

	iv.len = n * w * 4;
	ov.len = n * 4;
	s = (struct dmlc_submit){ .argsz = sizeof(s), .opcode = SCATTER, .dtype = F32,
		.root = first, .count = n, .in_iov = (uintptr_t)&iv,
		.in_cnt = info.rank == first, .out_iov = (uintptr_t)&ov, .out_cnt = 1 };
	submit_wait(&s);
	expect_ok("scatter", &s.done);
	check("scatter", out, n, want_scattered, &first);
	printf("rank %u: scatter of %llu f32 ok (%u device requests)\n", info.rank,
	       (unsigned long long)n, s.done.requests);
	free_f32(in);
	free_f32(out);
}

static int selftest(int quick)
{
	uint64_t big = info.chunk_bytes / 4 * 3 / 2 + 1;	/* two device requests */

	sync_group();
	test_refusals();
	test_old_argsz();
	test_comm_fields();
	test_allreduce(1, 0);
	test_allreduce(1000, 0);
	test_allreduce(big, 0);
	test_allreduce(big, 1);
	if (!quick)
		test_allreduce(big * 5 + 7, 0);
	test_others(quick ? 3000 : big);
	if (info.features & (1ull << DMLC_F_BLOCKS))
		test_blocks(quick ? 3000 : big);
	test_async();
	get_info();
	if (info.pinned_bytes || info.in_flight)
		die("pages still pinned after every completion was reaped (%s)", "pinned_bytes");
	printf("rank %u: all collectives ok: %u checks, nothing pinned after\n", info.rank, checks);
	return 0;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, n, sizeof(*v), cmp_double);
	return v[n / 2];
}

/* Median time of iters allreduces of bytes (malloc buffers), in us. */
static double time_allreduce(size_t bytes, int iters, double *p90)
{
	float *in = alloc_f32(bytes / 4), *out = alloc_f32(bytes / 4);
	double *t = calloc(iters, sizeof(*t));

	fill(in, info.rank, 0, bytes / 4);
	for (int i = -iters / 10 - 2; i < iters; i++) {
		double t0 = now_us();
		struct dmlc_completion c = run(ALLREDUCE, SUM, 0, bytes / 4, in, bytes,
					       out, bytes, 0);

		expect_ok("bench allreduce", &c);
		if (i >= 0)
			t[i] = now_us() - t0;
	}
	qsort(t, iters, sizeof(*t), cmp_double);
	if (p90)
		*p90 = t[iters * 9 / 10];
	double m = t[iters / 2];

	free(t);
	free_f32(in);
	free_f32(out);
	return m;
}

/* A copy of bytes between malloc buffers: what the userspace driver adds per direction. */
static double time_memcpy(size_t bytes, int iters)
{
	char *a = malloc(bytes), *b = malloc(bytes);
	double t[16];

	memset(a, 1, bytes);
	memset(b, 2, bytes);
	for (int i = 0; i < iters; i++) {
		double t0 = now_us();

		memcpy(b, a, bytes);
		t[i] = now_us() - t0;
	}
	free(a);
	free(b);
	return median(t, iters);
}

/*
 * Median time of a request with no buffer to pin: a barrier, or a nop (the
 * device answers it for this member alone: the floor of the kernel path).
 */
static double time_bufferless(int opcode, int iters)
{
	double *t = calloc(iters, sizeof(*t)), m;

	for (int i = -iters / 10 - 2; i < iters; i++) {
		double t0 = now_us();
		struct dmlc_completion c = run(opcode, 0, 0, 0, NULL, 0, NULL, 0, 0);

		expect_ok(opcode == NOP ? "bench nop" : "bench barrier", &c);
		if (i >= 0)
			t[i] = now_us() - t0;
	}
	m = median(t, iters);
	free(t);
	return m;
}

/* Median time of an ioctl the driver refuses at once: the system call alone. */
static double time_syscall(int iters)
{
	struct dmlc_submit s = { .argsz = sizeof(s), .flags = 1u << 7 };
	double *t = calloc(iters, sizeof(*t)), m;

	for (int i = 0; i < iters; i++) {
		double t0 = now_us();

		ioctl(fd, DMLC_IOC_SUBMIT, &s);
		t[i] = now_us() - t0;
	}
	m = median(t, iters);
	free(t);
	return m;
}

static int bench(int iters)
{
	double p90, lat, mib, big, cp, bar, sys, nop = 0;

	sync_group();
	sys = time_syscall(iters);
	if (info.opcodes & (1u << NOP))
		nop = time_bufferless(NOP, iters);
	bar = time_bufferless(BARRIER, iters);
	lat = time_allreduce(4, iters, &p90);
	mib = time_allreduce(1 << 20, 20, NULL);
	big = time_allreduce(64 << 20, 5, NULL);
	cp = time_memcpy(64 << 20, 5);
	if (info.rank == 0) {
		printf("kernel driver, malloc buffers, %u ranks, spin %u us\n",
		       info.world_size, spin_us);
		printf("ktest allreduce 4 B: p50 %.1f us p90 %.1f us (%d iters)\n",
		       lat, p90, iters);
		printf("ktest barrier: p50 %.1f us\n", bar);
		if (nop > 0)
			printf("ktest nop (the device's floor): p50 %.1f us\n", nop);
		printf("ktest refused ioctl (the system call alone): p50 %.1f us\n", sys);
		printf("ktest allreduce 1 MiB: median %.1f us\n", mib);
		printf("ktest allreduce 64 MiB: median %.1f us\n", big);
		printf("ktest memcpy 64 MiB (malloc to malloc): median %.1f us\n", cp);
	}
	return 0;
}

/* Submits an allreduce nobody else joins and waits to be killed. */
static int hold(void)
{
	size_t n = 65536;
	float *in = alloc_f32(n), *out = alloc_f32(n);
	struct dmlc_iovec iv = { (uintptr_t)in, n * 4 }, ov = { (uintptr_t)out, n * 4 };
	struct dmlc_submit s = { .argsz = sizeof(s), .opcode = ALLREDUCE,
		.dtype = F32, .count = n, .in_iov = (uintptr_t)&iv, .in_cnt = 1,
		.out_iov = (uintptr_t)&ov, .out_cnt = 1 };

	if (ioctl(fd, DMLC_IOC_SUBMIT, &s))
		die("DMLC_IOC_SUBMIT: %s", strerror(errno));
	get_info();
	printf("rank %u: holding collective %llu, %llu bytes pinned\n", info.rank,
	       (unsigned long long)s.id, (unsigned long long)info.pinned_total);
	fflush(stdout);
	for (;;)
		pause();
	return 0;
}

static void print_usage(int code)
{
	fprintf(code ? stderr : stdout,
		"usage: dmlc-ktest [--dev PATH] [--spin-us US] COMMAND\n"
		"commands: info, selftest [--quick], bench [--iters N], hold\n"
		"  info      print the device's config and the driver's counters\n"
		"  selftest  every collective on malloc buffers, checked by each rank\n"
		"  bench     4 B, 1 MiB and 64 MiB allreduce times (rank 0 prints)\n"
		"  hold      submit an allreduce nobody joins, then wait to be killed\n"
		"  --spin-us busy-poll this long before sleeping on the interrupt\n"
		"            (default 1000000: in effect, poll)\n");
	exit(code);
}

int main(int argc, char **argv)
{
	const char *dev = "/dev/dmlc0", *cmd = NULL;
	int quick = 0, iters = 1000;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--dev") && i + 1 < argc)
			dev = argv[++i];
		else if (!strcmp(argv[i], "--spin-us") && i + 1 < argc)
			spin_us = strtoul(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
			iters = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--quick"))
			quick = 1;
		else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help"))
			print_usage(0);
		else if (argv[i][0] != '-' && !cmd)
			cmd = argv[i];
		else
			print_usage(2);
	}
	if (!cmd || iters < 1)
		print_usage(2);
	fd = open(dev, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		die("cannot open the device: %s", strerror(errno));
	get_info();
	if (!strcmp(cmd, "info")) {
		printf("abi %u rank %u world %u queues %u max_segments %u chunk_bytes %u\n",
		       info.abi_version, info.rank, info.world_size, info.num_queues,
		       info.max_segments, info.chunk_bytes);
		printf("generation %u group_id %#llx features %#llx max_comms %u\n",
		       info.generation, (unsigned long long)info.group_id,
		       (unsigned long long)info.features, info.max_comms);
		printf("pinned_bytes %llu pinned_total %llu pinned_limit %llu",
		       (unsigned long long)info.pinned_bytes,
		       (unsigned long long)info.pinned_total,
		       (unsigned long long)info.pinned_limit);
		printf(" in_flight %u resets %u\n", info.in_flight, info.resets);
		return 0;
	}
	if (!strcmp(cmd, "selftest"))
		return selftest(quick);
	if (!strcmp(cmd, "bench"))
		return bench(iters);
	if (!strcmp(cmd, "hold"))
		return hold();
	print_usage(2);
}
