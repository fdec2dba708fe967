// SPDX-License-Identifier: GPL-2.0-only
/*
 * virtio_dmlc - Linux driver for the virtio-dmlc allreduce device.
 *
 * One misc character device per device (/dev/dmlcN). A collective is
 * submitted on the caller's own memory: the driver pins its pages, hands
 * them to the device as scatter lists (zero copy), and unpins them (dirty)
 * when the completion is reaped. Large collectives are split into device
 * requests of at most chunk_bytes per member block, so that a request never
 * needs more than max_segments descriptors; the split depends only on
 * values every member shares (opcode, dtype, count, world size,
 * max_segments), so the members' requests still pair up.
 *
 * Closing the file while the device still has its buffers resets the
 * device (spec 5.X.6.9: once the reset completes the device touches none of
 * them), unpins everything, and sets the device up again, so the group sees
 * a lost member that comes back.
 *
 * docs/kernel-driver.md has the ABI, the lifetime rules and how to change
 * this driver; docs/spec.md defines the device.
 */

#include <linux/idr.h>
#include <linux/kernel.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/poll.h>
#include <linux/scatterlist.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/virtio.h>
#include <linux/virtio_config.h>
#include <linux/wait.h>

#include "include/uapi/virtio_dmlc.h"

#if !IS_ENABLED(CONFIG_PM_SLEEP)
#error "virtio_dmlc resets the device through virtio_device_freeze/restore (CONFIG_PM_SLEEP)"
#endif

#define VIRTIO_ID_DMLC			63
#define VIRTIO_DMLC_F_REQ_TIMEOUT	0
#define VIRTIO_DMLC_F_COMM		1
#define VIRTIO_DMLC_F_P2P		2
#define VIRTIO_DMLC_F_BLOCKS		3
#define DMLC_FLAG_IN_PLACE		BIT(0)
#define DMLC_STATUS_OK			0
#define DMLC_OPCODE_MAX			17	/* comm_free */
#define DMLC_TABLE_PER_RANK		16	/* the largest table: alltoallv's */
#define DMLC_DTYPE_MAX			9	/* u64 */
#define DMLC_MAX_QUEUES			64
#define DMLC_MAX_IOV			1024
#define DMLC_MAX_OPS			1024	/* unreaped collectives per file */
#define DMLC_MAX_SEG_BYTES		SZ_1G	/* one descriptor */

enum { OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE, OP_ALLGATHER,
	OP_REDUCE_SCATTER, OP_BARRIER, OP_NOP,
	/* feature bits 1 to 3, spec 5.X.6.13.2 */
	OP_SEND, OP_RECV, OP_ALLTOALL, OP_ALLTOALLV, OP_GATHER, OP_GATHERV,
	OP_SCATTER, OP_SCATTERV, OP_COMM_SPLIT, OP_COMM_CREATE, OP_COMM_FREE };

/* Device layouts, spec 5.X.4 and 5.X.6.1 (little-endian). */
struct virtio_dmlc_config {
	__le32 rank;
	__le32 world_size;
	__le32 num_queues;
	__le32 max_segments;
	__le64 max_bytes;
	__le32 dtypes;
	__le32 ops;
	__le32 opcodes;
	__le32 generation;
	__le64 group_id;
};

struct virtio_dmlc_req {
	__le16 opcode;
	u8 dtype;
	u8 op;
	__le32 root;
	__le64 count;
	__le64 tag;
	__le32 flags;
	__le32 timeout_ms;
};

struct virtio_dmlc_resp {
	__le32 status;
	__le32 detail;
	__le32 peer;
	__le32 generation;
};

/* With feature bit 1 (spec 5.X.6.13.1). */
struct virtio_dmlc_config_comm {
	struct virtio_dmlc_config base;
	__le32 max_comms;
	__le32 reserved;
};

/* The header's fixed part; table_bytes of table follow it in one descriptor. */
struct virtio_dmlc_req_comm {
	struct virtio_dmlc_req base;
	__le32 comm;
	__le32 peer;
	__le32 key;
	__le32 table_bytes;
};

struct virtio_dmlc_resp_comm {
	struct virtio_dmlc_resp base;
	__le64 length;
	__le32 comm;
	__le32 comm_rank;
	__le32 comm_size;
	__le32 peer_world;
};

#define DMLC_MAX_COMMS_OFFSET	offsetof(struct virtio_dmlc_config_comm, max_comms)

static unsigned int pinned_limit_mb = 1024;
module_param(pinned_limit_mb, uint, 0644);
MODULE_PARM_DESC(pinned_limit_mb, "Most memory one open file may keep pinned (MiB)");

static unsigned int chunk_kb = 2048;
module_param(chunk_kb, uint, 0644);
MODULE_PARM_DESC(chunk_kb, "Largest per-block size of one device request (KiB); must be equal in every VM of a group");

static bool dmlc_comm = true;
module_param_named(comm, dmlc_comm, bool, 0444);
MODULE_PARM_DESC(comm, "Negotiate feature bits 1 to 3 (communicators, send and receive, all-to-all, gather, scatter) when the device offers them");

static DEFINE_IDA(dmlc_ida);

/* One buffer of a collective: the caller's pieces and their pinned pages. */
struct dmlc_piece {
	u64 addr;
	u64 len;
	u64 start;		/* offset of the piece in the buffer */
	unsigned int first;	/* index of its first page in pages[] */
};

/*
 * Small buffers (one piece, a few pages) need no allocation of their own,
 * and those of at most DMLC_SMALL_BYTES are copied instead of pinned:
 * pinning and unpinning cost more than the copy.
 */
#define DMLC_FEW_PAGES	4
#define DMLC_INLINE_SG	8
#define DMLC_SMALL_BYTES	256

struct dmlc_buf {
	struct dmlc_piece *pieces;
	unsigned int npieces;
	struct page **pages;
	unsigned int npages;	/* pinned */
	u64 len;
	bool write;
	bool copied;		/* in small[], not pinned */
	struct dmlc_piece one_piece;
	struct page *few_pages[DMLC_FEW_PAGES];
	u8 small[DMLC_SMALL_BYTES] __aligned(64);
};

struct dmlc_op;

/*
 * One device request: a chain [hdr] [inputs] [outputs] [resp]. Without
 * feature bit 1 the device sees hdr.base (32 bytes) and the first 16
 * bytes of resp; with it, hdr and its table (48 + table_bytes bytes, one
 * descriptor in this one allocation) and the whole 40-byte resp.
 */
struct dmlc_req {
	struct virtio_dmlc_resp_comm resp;
	struct dmlc_op *op;
	struct scatterlist *out_sg;	/* hdr, inputs */
	struct scatterlist *in_sg;	/* outputs, resp */
	struct scatterlist inline_sg[DMLC_INLINE_SG];
	struct virtio_dmlc_req_comm hdr;
	u8 table[];			/* right after hdr */
};

struct dmlc_file;

struct dmlc_op {
	struct list_head node;		/* dmlc_file.ops, then .ready */
	struct list_head pending;	/* dmlc_queue.pending while posting */
	struct dmlc_file *file;
	u64 id;
	u64 user_data;
	u32 queue;
	struct dmlc_buf in, out;
	u64 pinned;			/* bytes counted against the file */
	struct dmlc_req **reqs;
	struct dmlc_req *one_req;	/* reqs when there is one */
	unsigned int nreqs;
	unsigned int next;		/* first request not yet posted */
	unsigned int in_device;		/* posted, not yet used */
	bool failed;			/* post no more requests */
	bool ready;			/* the device is done with every buffer */
	bool claimed;			/* a waiter will reap it; read() skips it */
	struct mm_struct *mm;		/* the submitter's, for copied outputs */
	struct dmlc_completion done;
	struct dmlc_reply reply;	/* with done's status (feature bit 1) */
};

struct dmlc_queue {
	struct virtqueue *vq;
	struct list_head pending;	/* ops with requests to post, FIFO */
	unsigned int in_device;
	unsigned int spinners;		/* waiters busy-polling this queue */
};

struct dmlc_dev {
	struct virtio_device *vdev;
	struct miscdevice misc;
	char name[16];
	int index;
	struct kref ref;
	spinlock_t lock;		/* queues, ops, ready, generation */
	struct mutex open_lock;		/* owner, reset */
	struct dmlc_file *owner;
	struct dmlc_queue queues[DMLC_MAX_QUEUES];
	unsigned int nq;
	bool ready;			/* queues set up, DRIVER_OK */
	bool removed;
	wait_queue_head_t wq;
	/* config space values that do not change */
	u32 rank, world, max_segments, dtypes, ops, opcodes;
	u32 max_comms;			/* feature bit 1, else 0 */
	bool comm;			/* feature bit 1: 48-byte headers, 40-byte responses */
	u64 max_bytes;
	u32 generation;
	u32 resets;
	atomic64_t pinned_total;
};

struct dmlc_file {
	struct dmlc_dev *d;
	struct list_head ops;		/* submitted, device not done */
	struct list_head ready;		/* done, not yet reaped */
	struct mutex submit_lock;	/* pinned budget: check, pin, count */
	unsigned int nops;
	u64 next_id;
	u64 pinned;			/* under d->lock */
};

static const u8 dmlc_dtype_size[DMLC_DTYPE_MAX + 1] = {
	4, 8, 2, 2, 1, 1, 4, 4, 8, 8
};

static void dmlc_free_dev(struct kref *ref)
{
	struct dmlc_dev *d = container_of(ref, struct dmlc_dev, ref);

	ida_free(&dmlc_ida, d->index);
	kfree(d);
}

/* Bytes of one element; 1 for the opcodes that move no data. */
static unsigned int dmlc_esize(u16 opcode, u8 dtype)
{
	switch (opcode) {
	case OP_BARRIER:
	case OP_NOP:
	case OP_COMM_SPLIT:
	case OP_COMM_CREATE:
	case OP_COMM_FREE:
		return 1;
	default:
		return dmlc_dtype_size[dtype];
	}
}

/*
 * Elements of input and output per member of communicator 0
 * (virtio_dmlc::buffer_elems, comm::block_elems) for the opcodes the
 * driver may split. False for the others, and where the sizes overflow.
 */
static bool dmlc_buffer_elems(struct dmlc_dev *d, u16 opcode, u32 root,
			      u64 count, bool in_place, u64 *in, u64 *out)
{
	bool is_root = d->rank == root;
	u64 all;

	if (check_mul_overflow(count, (u64)d->world, &all))
		return false;
	switch (opcode) {
	case OP_ALLREDUCE:
		*in = count;
		*out = count;
		break;
	case OP_BROADCAST:
		*in = is_root ? count : 0;
		*out = count;
		break;
	case OP_REDUCE:
		*in = count;
		*out = (is_root || in_place) ? count : 0;
		break;
	case OP_ALLGATHER:
		*in = count;
		*out = all;
		break;
	case OP_REDUCE_SCATTER:
		*in = all;
		*out = in_place ? all : count;
		break;
	case OP_ALLTOALL:	/* no in-place form: the device refuses it */
		if (in_place)
			return false;
		*in = all;
		*out = all;
		break;
	case OP_GATHER:		/* in place, the root's buffer is its output */
		*in = count;
		*out = is_root ? all : 0;
		in_place = in_place && is_root;
		break;
	case OP_SCATTER:	/* in place, the root's buffer is its input */
		*in = is_root ? all : 0;
		*out = is_root && in_place ? all : count;
		in_place = in_place && is_root;
		break;
	default:
		return false;
	}
	if (in_place)
		*in = 0;
	return true;
}

static void dmlc_put_buf(struct dmlc_buf *b)
{
	if (b->npages)
		unpin_user_pages_dirty_lock(b->pages, b->npages, b->write);
	if (b->pages != b->few_pages)
		kvfree(b->pages);
	if (b->pieces != &b->one_piece)
		kfree(b->pieces);
	memset(b, 0, sizeof(*b));
}

/*
 * Copies the caller's iovecs and pins their pages. Each piece must be
 * aligned to the element size (so every page boundary is an element
 * boundary) and a whole number of elements long.
 */
static int dmlc_get_buf(struct dmlc_buf *b, u64 uiov, u32 cnt, bool write,
			unsigned int esize, u64 *budget)
{
	struct dmlc_iovec __user *up = u64_to_user_ptr(uiov);
	unsigned int i, total = 0;
	int ret;

	b->write = write;
	if (!cnt)
		return 0;
	if (cnt > DMLC_MAX_IOV)
		return -E2BIG;
	b->pieces = cnt == 1 ? &b->one_piece : kcalloc(cnt, sizeof(*b->pieces), GFP_KERNEL);
	if (!b->pieces)
		return -ENOMEM;
	for (i = 0; i < cnt; i++) {
		struct dmlc_iovec v;
		u64 first, last;

		if (copy_from_user(&v, &up[i], sizeof(v)))
			return -EFAULT;
		if (!v.len || v.addr % esize || v.len % esize ||
		    v.addr + v.len < v.addr)
			return -EINVAL;
		first = v.addr >> PAGE_SHIFT;
		last = (v.addr + v.len - 1) >> PAGE_SHIFT;
		if (last - first + 1 > INT_MAX - total)
			return -E2BIG;
		b->pieces[i].addr = v.addr;
		b->pieces[i].len = v.len;
		b->pieces[i].start = b->len;
		b->pieces[i].first = total;
		b->len += v.len;
		total += last - first + 1;
	}
	b->npieces = cnt;
	if (b->len <= DMLC_SMALL_BYTES) {
		for (i = 0; i < cnt; i++)
			if (copy_from_user(b->small + b->pieces[i].start,
					   u64_to_user_ptr(b->pieces[i].addr), b->pieces[i].len))
				return -EFAULT;
		b->copied = true;
		return 0;
	}
	if ((u64)total << PAGE_SHIFT > *budget)
		return -ENOMEM;
	b->pages = total <= DMLC_FEW_PAGES ? b->few_pages :
		   kvmalloc_array(total, sizeof(*b->pages), GFP_KERNEL);
	if (!b->pages)
		return -ENOMEM;
	for (i = 0; i < cnt; i++) {
		struct dmlc_piece *p = &b->pieces[i];
		unsigned long start = p->addr & PAGE_MASK;
		unsigned int n = ((p->addr + p->len - 1) >> PAGE_SHIFT) -
				 (p->addr >> PAGE_SHIFT) + 1;
		unsigned int got = 0;

		while (got < n) {
			ret = pin_user_pages_fast(start + ((unsigned long)got << PAGE_SHIFT),
						  n - got,
						  FOLL_LONGTERM | (write ? FOLL_WRITE : 0),
						  b->pages + b->npages);
			if (ret <= 0)
				return ret ? ret : -EFAULT;
			got += ret;
			b->npages += ret;
		}
	}
	*budget -= (u64)total << PAGE_SHIFT;
	return 0;
}

/*
 * Fills sg (or, with sg NULL, only counts) with the entries for bytes
 * [off, off + len) of b, merging physically contiguous pages. Returns the
 * number of entries.
 */
static unsigned int dmlc_map_range(struct dmlc_buf *b, u64 off, u64 len,
				   struct scatterlist *sg)
{
	unsigned int n = 0, i = 0;
	struct page *prev = NULL;
	unsigned int prev_off = 0, prev_len = 0;

	if (b->copied) {
		if (sg)
			sg_set_buf(sg, b->small + off, len);
		return 1;
	}
	while (i < b->npieces && b->pieces[i].start + b->pieces[i].len <= off)
		i++;
	while (len && i < b->npieces) {
		struct dmlc_piece *p = &b->pieces[i];
		u64 uaddr = p->addr + (off - p->start);
		unsigned int poff = uaddr & ~PAGE_MASK;
		u64 take = min3(len, (u64)(PAGE_SIZE - poff), p->start + p->len - off);
		struct page *pg = b->pages[p->first + (uaddr >> PAGE_SHIFT) -
					   (p->addr >> PAGE_SHIFT)];

		if (prev && poff == 0 && (prev_off + prev_len) % PAGE_SIZE == 0 &&
		    page_to_pfn(pg) == page_to_pfn(prev) + (prev_off + prev_len) / PAGE_SIZE &&
		    prev_len + take <= DMLC_MAX_SEG_BYTES) {
			prev_len += take;
		} else {
			if (prev && sg)
				sg_set_page(&sg[n - 1], prev, prev_len, prev_off);
			prev = pg;
			prev_off = poff;
			prev_len = take;
			n++;
		}
		off += take;
		len -= take;
		if (off == p->start + p->len)
			i++;
	}
	if (prev && sg)
		sg_set_page(&sg[n - 1], prev, prev_len, prev_off);
	return n;
}

/* Per-block bytes of one device request for this collective. */
static u64 dmlc_chunk_bytes(struct dmlc_dev *d, u16 opcode)
{
	u64 blocks, segs, bytes;

	switch (opcode) {
	case OP_ALLGATHER:
	case OP_REDUCE_SCATTER:
	case OP_GATHER:
	case OP_SCATTER:
		blocks = (u64)d->world + 1;
		break;
	case OP_ALLTOALL:
		blocks = 2 * (u64)d->world;
		break;
	default:
		blocks = 2;
	}
	segs = d->max_segments / blocks;

	if (segs < 2)
		return 0;		/* too many blocks: never split */
	bytes = min_t(u64, (segs - 1) * PAGE_SIZE, (u64)chunk_kb * SZ_1K);
	return max_t(u64, bytes, PAGE_SIZE);
}

/*
 * Appends to sg the entries of the element range [a, b) of every block of
 * buf (blocks of count elements). Returns the entries added.
 */
static unsigned int dmlc_map_blocks(struct dmlc_buf *buf, u64 blocks, u64 count,
				    u64 a, u64 b, unsigned int esize,
				    struct scatterlist *sg)
{
	unsigned int n = 0;
	u64 j;

	if (!buf->len)
		return 0;
	if (!blocks)		/* not split: the whole buffer */
		return dmlc_map_range(buf, 0, buf->len, sg);
	for (j = 0; j < blocks; j++)
		n += dmlc_map_range(buf, (j * count + a) * esize, (b - a) * esize,
				    sg ? sg + n : NULL);
	return n;
}

static void dmlc_free_reqs(struct dmlc_op *op)
{
	unsigned int i;

	for (i = 0; i < op->nreqs; i++) {
		struct dmlc_req *r = op->reqs[i];

		if (!r)
			continue;
		if (r->out_sg != r->inline_sg) {
			kvfree(r->out_sg);
			kvfree(r->in_sg);
		}
		kfree(r);
	}
	if (op->reqs != &op->one_req)
		kvfree(op->reqs);
	op->reqs = NULL;
	op->nreqs = 0;
}

/* True if the buffers have the sizes the collective needs. */
static bool dmlc_well_formed(struct dmlc_dev *d, struct dmlc_op *op,
			     const struct dmlc_submit *s, unsigned int esize,
			     u64 *in_elems, u64 *out_elems)
{
	bool in_place = s->flags & DMLC_SUBMIT_IN_PLACE;
	u64 in_bytes, out_bytes;

	return dmlc_buffer_elems(d, s->opcode, s->root, s->count, in_place,
				 in_elems, out_elems) &&
	       !check_mul_overflow(*in_elems, (u64)esize, &in_bytes) &&
	       !check_mul_overflow(*out_elems, (u64)esize, &out_bytes) &&
	       op->in.len == in_bytes && op->out.len == out_bytes;
}

static int dmlc_build_reqs(struct dmlc_dev *d, struct dmlc_op *op,
			   const struct dmlc_submit *s)
{
	unsigned int esize = dmlc_esize(s->opcode, s->dtype);
	bool in_place = s->flags & DMLC_SUBMIT_IN_PLACE;
	size_t hdr_len = d->comm ? sizeof(struct virtio_dmlc_req_comm) + s->table_bytes :
			 sizeof(struct virtio_dmlc_req);
	size_t resp_len = d->comm ? sizeof(struct virtio_dmlc_resp_comm) :
			  sizeof(struct virtio_dmlc_resp);
	u64 in_elems = 0, out_elems = 0, chunk = 0, nreqs = 1, in_blocks = 0, out_blocks = 0;
	u64 k;

	/*
	 * Split only a well-formed collective of communicator 0 without a
	 * table (the driver knows no other communicator's size or ranks);
	 * the device judges the rest.
	 */
	if (!s->comm && !s->table_bytes &&
	    dmlc_well_formed(d, op, s, esize, &in_elems, &out_elems))
		chunk = dmlc_chunk_bytes(d, s->opcode) / esize;
	if (chunk && s->count > chunk) {
		nreqs = DIV_ROUND_UP(s->count, chunk);
		in_blocks = in_elems / s->count;
		out_blocks = out_elems / s->count;
	} else {
		chunk = s->count;
	}
	if (nreqs > INT_MAX / 2)
		return -E2BIG;
	op->reqs = nreqs == 1 ? &op->one_req : kvcalloc(nreqs, sizeof(*op->reqs), GFP_KERNEL);
	if (!op->reqs)
		return -ENOMEM;
	op->nreqs = nreqs;
	for (k = 0; k < nreqs; k++) {
		u64 a = k * chunk, b = min(s->count, a + chunk);
		unsigned int nin, nout;
		struct dmlc_req *r;

		nin = dmlc_map_blocks(&op->in, in_blocks, s->count, a, b, esize, NULL);
		nout = dmlc_map_blocks(&op->out, out_blocks, s->count, a, b, esize, NULL);
		if (nin + nout > d->max_segments)
			return -E2BIG;
		/* A table never comes with a split: nreqs is 1. */
		r = kzalloc(struct_size(r, table, s->table_bytes), GFP_KERNEL);
		if (!r)
			return -ENOMEM;
		op->reqs[k] = r;
		r->op = op;
		if (nin + nout + 2 <= DMLC_INLINE_SG) {
			r->out_sg = r->inline_sg;
			r->in_sg = r->inline_sg + nin + 1;
		} else {
			r->out_sg = kvmalloc_array(nin + 1, sizeof(*r->out_sg), GFP_KERNEL);
			r->in_sg = kvmalloc_array(nout + 1, sizeof(*r->in_sg), GFP_KERNEL);
			if (!r->out_sg || !r->in_sg)
				return -ENOMEM;
		}
		sg_init_table(r->out_sg, nin + 1);
		sg_init_table(r->in_sg, nout + 1);
		sg_set_buf(&r->out_sg[0], &r->hdr, hdr_len);
		dmlc_map_blocks(&op->in, in_blocks, s->count, a, b, esize, r->out_sg + 1);
		dmlc_map_blocks(&op->out, out_blocks, s->count, a, b, esize, r->in_sg);
		sg_set_buf(&r->in_sg[nout], &r->resp, resp_len);
		r->hdr.base.opcode = cpu_to_le16(s->opcode);
		r->hdr.base.dtype = s->dtype;
		r->hdr.base.op = s->op;
		r->hdr.base.root = cpu_to_le32(s->root);
		r->hdr.base.count = cpu_to_le64(b - a);
		r->hdr.base.tag = cpu_to_le64(s->tag);
		r->hdr.base.flags = cpu_to_le32(in_place ? DMLC_FLAG_IN_PLACE : 0);
		r->hdr.base.timeout_ms = cpu_to_le32(s->timeout_ms);
		r->hdr.comm = cpu_to_le32(s->comm);
		r->hdr.peer = cpu_to_le32(s->peer);
		r->hdr.key = cpu_to_le32(s->key);
		r->hdr.table_bytes = cpu_to_le32(s->table_bytes);
		if (copy_from_user(r->table, u64_to_user_ptr(s->table), s->table_bytes))
			return -EFAULT;
		r->resp.base.status = cpu_to_le32(U32_MAX);
	}
	return 0;
}

/* Under d->lock: the op's last device request is used, or it failed. */
static void dmlc_maybe_ready(struct dmlc_dev *d, struct dmlc_op *op)
{
	if (op->ready || op->in_device || (!op->failed && op->next < op->nreqs))
		return;
	op->ready = true;
	list_del_init(&op->pending);
	list_move_tail(&op->node, &op->file->ready);
	wake_up_all(&d->wq);
}

static void dmlc_fail_locked(struct dmlc_dev *d, struct dmlc_op *op, int err)
{
	if (!op->failed && !op->done.error && op->done.status == DMLC_STATUS_OK)
		op->done.error = err;
	op->failed = true;
	dmlc_maybe_ready(d, op);
}

/* Under d->lock: posts what fits; true if the device must be notified. */
static bool dmlc_post_locked(struct dmlc_dev *d, struct dmlc_queue *q)
{
	bool posted = false;

	while (d->ready && !list_empty(&q->pending)) {
		struct dmlc_op *op = list_first_entry(&q->pending, struct dmlc_op, pending);
		struct dmlc_req *r;
		struct scatterlist *sgs[2];
		int err;

		if (op->failed || op->next == op->nreqs) {
			list_del_init(&op->pending);
			dmlc_maybe_ready(d, op);
			continue;
		}
		r = op->reqs[op->next];
		sgs[0] = r->out_sg;
		sgs[1] = r->in_sg;
		err = virtqueue_add_sgs(q->vq, sgs, 1, 1, r, GFP_ATOMIC);
		if (err == -ENOSPC && q->in_device)
			break;		/* room comes with the next completion */
		if (err) {
			dmlc_fail_locked(d, op, err == -ENOSPC ? -E2BIG : err);
			continue;
		}
		op->next++;
		op->in_device++;
		q->in_device++;
		posted = true;
	}
	return posted && virtqueue_kick_prepare(q->vq);
}

/* Under d->lock: collects used requests; then posts what now fits. */
static bool dmlc_harvest_locked(struct dmlc_dev *d, struct dmlc_queue *q)
{
	size_t resp_len = d->comm ? sizeof(struct virtio_dmlc_resp_comm) :
			  sizeof(struct virtio_dmlc_resp);
	struct dmlc_req *r;
	unsigned int len;

	while (d->ready && (r = virtqueue_get_buf(q->vq, &len))) {
		struct dmlc_op *op = r->op;
		u32 status = le32_to_cpu(r->resp.base.status);

		q->in_device--;
		op->in_device--;
		op->done.requests++;
		op->done.written += len;
		if (len < resp_len || status == U32_MAX) {
			dmlc_fail_locked(d, op, -EIO);
			continue;
		}
		if (!op->failed) {
			op->done.status = status;
			op->done.detail = le32_to_cpu(r->resp.base.detail);
			op->done.peer = le32_to_cpu(r->resp.base.peer);
			op->done.generation = le32_to_cpu(r->resp.base.generation);
			if (d->comm) {
				op->reply.length = le64_to_cpu(r->resp.length);
				op->reply.comm = le32_to_cpu(r->resp.comm);
				op->reply.comm_rank = le32_to_cpu(r->resp.comm_rank);
				op->reply.comm_size = le32_to_cpu(r->resp.comm_size);
				op->reply.peer_world = le32_to_cpu(r->resp.peer_world);
			}
			if (status != DMLC_STATUS_OK)
				op->failed = true;
		}
		dmlc_maybe_ready(d, op);
	}
	return dmlc_post_locked(d, q);
}

static void dmlc_vq_done(struct virtqueue *vq)
{
	struct dmlc_dev *d = vq->vdev->priv;
	struct dmlc_queue *q = &d->queues[vq->index];
	unsigned long flags;

	spin_lock_irqsave(&d->lock, flags);
	if (dmlc_harvest_locked(d, q))
		virtqueue_notify(vq);
	spin_unlock_irqrestore(&d->lock, flags);
}

static void dmlc_config_changed(struct virtio_device *vdev)
{
	struct dmlc_dev *d = vdev->priv;
	u32 gen = virtio_cread32(vdev, offsetof(struct virtio_dmlc_config, generation));
	unsigned long flags;

	spin_lock_irqsave(&d->lock, flags);
	d->generation = gen;
	spin_unlock_irqrestore(&d->lock, flags);
	dev_dbg(&vdev->dev, "group generation %u\n", gen);
	wake_up_all(&d->wq);
}

static int dmlc_init_vqs(struct dmlc_dev *d)
{
	struct {
		struct virtqueue *vqs[DMLC_MAX_QUEUES];
		char names[DMLC_MAX_QUEUES][16];
#ifdef DMLC_HAVE_VIRTQUEUE_INFO
		struct virtqueue_info info[DMLC_MAX_QUEUES];
#else
		vq_callback_t *cbs[DMLC_MAX_QUEUES];
		const char *np[DMLC_MAX_QUEUES];
#endif
	} *t = kzalloc(sizeof(*t), GFP_KERNEL);
	unsigned int i;
	int err;

	if (!t)
		return -ENOMEM;
	for (i = 0; i < d->nq; i++) {
		snprintf(t->names[i], sizeof(t->names[i]), "req%u", i);
#ifdef DMLC_HAVE_VIRTQUEUE_INFO
		t->info[i].name = t->names[i];
		t->info[i].callback = dmlc_vq_done;
#else
		t->cbs[i] = dmlc_vq_done;
		t->np[i] = t->names[i];
#endif
	}
#ifdef DMLC_HAVE_VIRTQUEUE_INFO
	err = virtio_find_vqs(d->vdev, d->nq, t->vqs, t->info, NULL);
#else
	err = virtio_find_vqs(d->vdev, d->nq, t->vqs, t->cbs, t->np, NULL);
#endif
	for (i = 0; !err && i < d->nq; i++) {
		d->queues[i].vq = t->vqs[i];
		d->queues[i].in_device = 0;
		d->queues[i].spinners = 0;
		INIT_LIST_HEAD(&d->queues[i].pending);
	}
	kfree(t);
	return err;
}

/*
 * Resets the device and ends every collective still in it with err: after
 * virtio_reset_device() returns the device touches none of their buffers.
 */
static void dmlc_stop(struct dmlc_dev *d, int err)
{
	unsigned int i;
	struct dmlc_req *r;

	spin_lock_irq(&d->lock);
	d->ready = false;
	spin_unlock_irq(&d->lock);
	virtio_reset_device(d->vdev);
	spin_lock_irq(&d->lock);
	for (i = 0; i < d->nq; i++) {
		struct dmlc_queue *q = &d->queues[i];
		struct dmlc_op *op, *tmp;

		while ((r = virtqueue_detach_unused_buf(q->vq))) {
			r->op->in_device--;
			dmlc_fail_locked(d, r->op, err);
		}
		q->in_device = 0;
		list_for_each_entry_safe(op, tmp, &q->pending, pending)
			dmlc_fail_locked(d, op, err);
	}
	spin_unlock_irq(&d->lock);
	d->vdev->config->del_vqs(d->vdev);
	wake_up_all(&d->wq);
}

static int dmlc_start(struct dmlc_dev *d)
{
	int err = dmlc_init_vqs(d);

	if (err)
		return err;
	spin_lock_irq(&d->lock);
	d->ready = true;
	spin_unlock_irq(&d->lock);
	return 0;
}

static bool dmlc_op_ready(struct dmlc_dev *d, struct dmlc_op *op)
{
	bool r;

	spin_lock_irq(&d->lock);
	r = op->ready;
	spin_unlock_irq(&d->lock);
	return r;
}

/* Under d->lock: a waiter polls q; its completions need no interrupt. */
static void dmlc_spin_begin(struct dmlc_queue *q)
{
	if (!q->spinners++)
		virtqueue_disable_cb(q->vq);
}

/*
 * Ends a dmlc_spin_begin(); the last poller turns interrupts back on and
 * collects what completed meanwhile. A reset in between set every count
 * to 0 with the new queues.
 */
static void dmlc_spin_end(struct dmlc_dev *d, struct dmlc_queue *q)
{
	spin_lock_irq(&d->lock);
	if (d->ready && q->spinners && !--q->spinners &&
	    !virtqueue_enable_cb(q->vq) && dmlc_harvest_locked(d, q))
		virtqueue_notify(q->vq);
	spin_unlock_irq(&d->lock);
}

/*
 * Busy-polls op's queue for up to spin_us, with its interrupts off. With
 * begun, the caller did dmlc_spin_begin() already (before posting, so that
 * a quick completion raises no interrupt either).
 */
static void dmlc_spin(struct dmlc_dev *d, struct dmlc_op *op, u32 spin_us, bool begun)
{
	ktime_t end = ktime_add_us(ktime_get(), spin_us);
	struct dmlc_queue *q = &d->queues[op->queue];
	bool done = false;

	spin_lock_irq(&d->lock);
	if (!begun) {
		if (!d->ready) {
			spin_unlock_irq(&d->lock);
			return;
		}
		dmlc_spin_begin(q);
	}
	spin_unlock_irq(&d->lock);
	while (!done) {
		spin_lock_irq(&d->lock);
		if (d->ready && dmlc_harvest_locked(d, q))
			virtqueue_notify(q->vq);
		done = op->ready || !d->ready;
		spin_unlock_irq(&d->lock);
		if (done || signal_pending(current) || ktime_after(ktime_get(), end))
			break;
		cond_resched();
		cpu_relax();
	}
	dmlc_spin_end(d, q);
}

/*
 * A copied output goes back to the caller's pieces, in the process that
 * submitted it (another process sharing the file gets -EFAULT).
 */
static void dmlc_copy_back(struct dmlc_op *op)
{
	struct dmlc_buf *b = &op->out;
	unsigned int i;

	if (!b->copied || !b->npieces)
		return;
	if (current->mm != op->mm) {
		op->done.error = op->done.error ?: -EFAULT;
		return;
	}
	for (i = 0; i < b->npieces; i++)
		if (copy_to_user(u64_to_user_ptr(b->pieces[i].addr),
				 b->small + b->pieces[i].start, b->pieces[i].len))
			op->done.error = op->done.error ?: -EFAULT;
}

/* Releases a ready op's pages and frees it; fills *c and *reply. */
static void dmlc_reap(struct dmlc_file *f, struct dmlc_op *op,
		      struct dmlc_completion *c, struct dmlc_reply *reply)
{
	struct dmlc_dev *d = f->d;

	if (c) {
		dmlc_copy_back(op);
		*c = op->done;
	}
	if (reply)
		*reply = op->reply;
	dmlc_put_buf(&op->in);
	dmlc_put_buf(&op->out);
	dmlc_free_reqs(op);
	if (op->mm)
		mmdrop(op->mm);
	spin_lock_irq(&d->lock);
	list_del(&op->node);
	f->nops--;
	f->pinned -= op->pinned;
	spin_unlock_irq(&d->lock);
	atomic64_sub(op->pinned, &d->pinned_total);
	kfree(op);
}

/*
 * Waits for op, which the caller claimed, and reaps it. A wait that ends
 * early gives the claim back: the op stays for a later wait or read().
 */
static int dmlc_wait_op(struct dmlc_file *f, struct dmlc_op *op, u32 spin_us,
			u32 timeout_ms, bool begun, struct dmlc_completion *c,
			struct dmlc_reply *reply)
{
	struct dmlc_dev *d = f->d;
	long left;

	if (spin_us)
		dmlc_spin(d, op, spin_us, begun);
	if (timeout_ms) {
		left = wait_event_interruptible_timeout(d->wq, dmlc_op_ready(d, op),
							msecs_to_jiffies(timeout_ms));
	} else {
		left = wait_event_interruptible(d->wq, dmlc_op_ready(d, op)) ?: 1;
	}
	if (left <= 0) {
		spin_lock_irq(&d->lock);
		op->claimed = false;
		spin_unlock_irq(&d->lock);
		return left ? -EINTR : -ETIMEDOUT;
	}
	dmlc_reap(f, op, c, reply);
	return 0;
}

static struct dmlc_op *dmlc_find_op(struct dmlc_file *f, u64 id)
{
	struct dmlc_op *op;

	list_for_each_entry(op, &f->ops, node)
		if (op->id == id)
			return op;
	list_for_each_entry(op, &f->ready, node)
		if (op->id == id)
			return op;
	return NULL;
}

/* Reads an argsz-headed struct: the known prefix, zeros after it. */
static int dmlc_copy_in(void *dst, size_t size, size_t min, void __user *src)
{
	u32 argsz;

	if (get_user(argsz, (u32 __user *)src))
		return -EFAULT;
	if (argsz < min)
		return -EINVAL;
	memset(dst, 0, size);
	if (copy_from_user(dst, src, min_t(size_t, argsz, size)))
		return -EFAULT;
	return 0;
}

static int dmlc_copy_out(void __user *dst, const void *src, size_t size)
{
	u32 argsz = *(const u32 *)src;

	return copy_to_user(dst, src, min_t(size_t, argsz, size)) ? -EFAULT : 0;
}

static long dmlc_ioctl_info(struct dmlc_file *f, void __user *arg)
{
	struct dmlc_dev *d = f->d;
	struct dmlc_info info;
	int err = dmlc_copy_in(&info, sizeof(info), offsetofend(struct dmlc_info, flags), arg);

	if (err)
		return err;
	if (info.flags)
		return -EINVAL;
	mutex_lock(&d->open_lock);
	if (d->removed) {
		mutex_unlock(&d->open_lock);
		return -ENODEV;
	}
	info.abi_version = DMLC_ABI_VERSION;
	info.rank = d->rank;
	info.world_size = d->world;
	info.num_queues = d->nq;
	info.max_segments = d->max_segments;
	info.dtypes = d->dtypes;
	info.ops = d->ops;
	info.opcodes = d->opcodes;
	info.generation = virtio_cread32(d->vdev,
					 offsetof(struct virtio_dmlc_config, generation));
	info.group_id = virtio_cread64(d->vdev,
				       offsetof(struct virtio_dmlc_config, group_id));
	info.chunk_bytes = min_t(u64, dmlc_chunk_bytes(d, OP_ALLREDUCE), U32_MAX);
	info.max_bytes = d->max_bytes;
	info.features = d->vdev->features;
	info.pinned_limit = (u64)pinned_limit_mb << 20;
	info.pinned_bytes = f->pinned;
	info.pinned_total = atomic64_read(&d->pinned_total);
	info.in_flight = f->nops;
	info.resets = d->resets;
	info.max_comms = d->max_comms;
	mutex_unlock(&d->open_lock);
	return dmlc_copy_out(arg, &info, sizeof(info));
}

static long dmlc_ioctl_submit(struct dmlc_file *f, void __user *arg)
{
	struct dmlc_dev *d = f->d;
	struct dmlc_submit s;
	struct dmlc_op *op;
	struct dmlc_queue *q;
	unsigned int esize;
	u64 budget, limit = (u64)pinned_limit_mb << 20;
	int err = dmlc_copy_in(&s, sizeof(s), offsetof(struct dmlc_submit, id), arg);

	if (err)
		return err;
	if (s.flags & ~DMLC_SUBMIT_FLAGS || s.opcode > DMLC_OPCODE_MAX ||
	    s.dtype > DMLC_DTYPE_MAX || s.queue >= d->nq)
		return -EINVAL;
	/* The 32-byte header has no room for these (spec 5.X.6.13.1). */
	if (!d->comm && (s.comm || s.peer || s.key || s.table_bytes))
		return -EOPNOTSUPP;
	/* The device refuses a larger table; refused before it is allocated. */
	if (s.table_bytes > (u64)DMLC_TABLE_PER_RANK * d->world)
		return -EINVAL;
	if (READ_ONCE(f->nops) >= DMLC_MAX_OPS)
		return -EBUSY;
	esize = dmlc_esize(s.opcode, s.dtype);
	op = kzalloc(sizeof(*op), GFP_KERNEL);
	if (!op)
		return -ENOMEM;
	INIT_LIST_HEAD(&op->pending);
	INIT_LIST_HEAD(&op->node);
	op->file = f;
	op->queue = s.queue;
	op->user_data = s.user_data;
	op->claimed = s.flags & DMLC_SUBMIT_WAIT;
	mutex_lock(&f->submit_lock);
	spin_lock_irq(&d->lock);
	budget = limit > f->pinned ? limit - f->pinned : 0;
	spin_unlock_irq(&d->lock);
	err = dmlc_get_buf(&op->in, s.in_iov, s.in_cnt, false, esize, &budget);
	if (!err)
		err = dmlc_get_buf(&op->out, s.out_iov, s.out_cnt, true, esize, &budget);
	if (!err && op->out.copied && op->out.npieces) {
		/* Held so that the pointer names this process until reaped. */
		op->mm = current->mm;
		mmgrab(op->mm);
	}
	op->pinned = (u64)(op->in.npages + op->out.npages) << PAGE_SHIFT;
	spin_lock_irq(&d->lock);
	f->pinned += op->pinned;
	spin_unlock_irq(&d->lock);
	mutex_unlock(&f->submit_lock);
	atomic64_add(op->pinned, &d->pinned_total);
	if (!err)
		err = dmlc_build_reqs(d, op, &s);
	if (err)
		goto fail;

	q = &d->queues[s.queue];
	spin_lock_irq(&d->lock);
	if (!d->ready) {
		spin_unlock_irq(&d->lock);
		err = d->removed ? -ENODEV : -EAGAIN;
		goto fail;
	}
	op->id = ++f->next_id;
	op->done.id = op->id;
	op->done.user_data = op->user_data;
	list_add_tail(&op->node, &f->ops);
	f->nops++;
	list_add_tail(&op->pending, &q->pending);
	if ((s.flags & DMLC_SUBMIT_WAIT) && s.spin_us)
		dmlc_spin_begin(q);
	if (dmlc_post_locked(d, q))
		virtqueue_notify(q->vq);
	spin_unlock_irq(&d->lock);

	s.id = op->id;
	if (s.flags & DMLC_SUBMIT_WAIT) {
		err = dmlc_wait_op(f, op, s.spin_us, s.wait_ms, true, &s.done, &s.reply);
		/* A wait that ended early hands back the id, to wait again. */
		if (err)
			return dmlc_copy_out(arg, &s, sizeof(s)) ?: err;
	}
	return dmlc_copy_out(arg, &s, sizeof(s));

fail:
	if (op->mm)
		mmdrop(op->mm);
	dmlc_put_buf(&op->in);
	dmlc_put_buf(&op->out);
	spin_lock_irq(&d->lock);
	f->pinned -= op->pinned;
	spin_unlock_irq(&d->lock);
	atomic64_sub(op->pinned, &d->pinned_total);
	dmlc_free_reqs(op);
	kfree(op);
	return err;
}

static long dmlc_ioctl_wait(struct dmlc_file *f, void __user *arg)
{
	struct dmlc_wait w;
	struct dmlc_op *op;
	int err = dmlc_copy_in(&w, sizeof(w), offsetof(struct dmlc_wait, done), arg);

	if (err)
		return err;
	if (w.flags & ~DMLC_WAIT_FLAGS)
		return -EINVAL;
	spin_lock_irq(&f->d->lock);
	op = dmlc_find_op(f, w.id);
	if (op && (w.flags & DMLC_WAIT_PEEK))
		err = op->ready ? 0 : -EAGAIN;
	else if (op && op->claimed)
		err = -EBUSY;		/* another thread waits for it */
	else if (op)
		op->claimed = true;
	spin_unlock_irq(&f->d->lock);
	if (!op)
		return -ENOENT;
	if (err || (w.flags & DMLC_WAIT_PEEK))
		return err;
	err = dmlc_wait_op(f, op, w.spin_us, w.timeout_ms, false, &w.done, &w.reply);
	if (err)
		return err;
	return dmlc_copy_out(arg, &w, sizeof(w));
}

/*
 * One file's calls run one at a time: reaping frees ops that another
 * caller might be looking at, and the counters are the file's.
 */
static long dmlc_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct dmlc_file *f = file->private_data;
	void __user *up = (void __user *)arg;

	switch (cmd) {
	case DMLC_IOC_INFO:
		return dmlc_ioctl_info(f, up);
	case DMLC_IOC_SUBMIT:
		return dmlc_ioctl_submit(f, up);
	case DMLC_IOC_WAIT:
		return dmlc_ioctl_wait(f, up);
	default:
		return -ENOTTY;
	}
}

/* Under d->lock: the oldest ready op that no waiter claimed. */
static struct dmlc_op *dmlc_first_unclaimed(struct dmlc_file *f)
{
	struct dmlc_op *op;

	list_for_each_entry(op, &f->ready, node)
		if (!op->claimed)
			return op;
	return NULL;
}

static bool dmlc_has_unclaimed(struct dmlc_file *f)
{
	bool any;

	spin_lock_irq(&f->d->lock);
	any = dmlc_first_unclaimed(f);
	spin_unlock_irq(&f->d->lock);
	return any;
}

/* Reaps ready collectives in completion order, one record each. */
static ssize_t dmlc_read(struct file *file, char __user *buf, size_t len,
			 loff_t *ppos)
{
	struct dmlc_file *f = file->private_data;
	struct dmlc_dev *d = f->d;
	ssize_t done = 0;

	if (len < sizeof(struct dmlc_completion))
		return -EINVAL;
	if (!(file->f_flags & O_NONBLOCK) &&
	    wait_event_interruptible(d->wq, dmlc_has_unclaimed(f)))
		return -EINTR;
	while (len - done >= sizeof(struct dmlc_completion)) {
		struct dmlc_completion c;
		struct dmlc_op *op;

		spin_lock_irq(&d->lock);
		op = dmlc_first_unclaimed(f);
		if (op)
			op->claimed = true;
		spin_unlock_irq(&d->lock);
		if (!op)
			break;
		dmlc_reap(f, op, &c, NULL);
		if (copy_to_user(buf + done, &c, sizeof(c)))
			return done ? done : -EFAULT;
		done += sizeof(c);
	}
	return done ? done : -EAGAIN;
}

static __poll_t dmlc_poll(struct file *file, poll_table *wait)
{
	struct dmlc_file *f = file->private_data;
	struct dmlc_dev *d = f->d;
	__poll_t mask = 0;

	poll_wait(file, &d->wq, wait);
	spin_lock_irq(&d->lock);
	if (dmlc_first_unclaimed(f))
		mask |= EPOLLIN | EPOLLRDNORM;
	if (d->removed)
		mask |= EPOLLHUP;
	spin_unlock_irq(&d->lock);
	return mask;
}

static int dmlc_open(struct inode *inode, struct file *file)
{
	struct miscdevice *misc = file->private_data;
	struct dmlc_dev *d = container_of(misc, struct dmlc_dev, misc);
	struct dmlc_file *f;

	f = kzalloc(sizeof(*f), GFP_KERNEL);
	if (!f)
		return -ENOMEM;
	mutex_lock(&d->open_lock);
	if (d->owner || d->removed) {
		mutex_unlock(&d->open_lock);
		kfree(f);
		return d->removed ? -ENODEV : -EBUSY;
	}
	d->owner = f;
	kref_get(&d->ref);
	mutex_unlock(&d->open_lock);
	f->d = d;
	mutex_init(&f->submit_lock);
	INIT_LIST_HEAD(&f->ops);
	INIT_LIST_HEAD(&f->ready);
	file->private_data = f;
	return nonseekable_open(inode, file);
}

/*
 * The last close: nothing of the file may stay pinned or in the device. If
 * the device still holds buffers, reset it, then set it up again.
 */
static int dmlc_release(struct inode *inode, struct file *file)
{
	struct dmlc_file *f = file->private_data;
	struct dmlc_dev *d = f->d;
	struct dmlc_op *op, *tmp;
	bool busy;

	mutex_lock(&d->open_lock);
	spin_lock_irq(&d->lock);
	busy = !list_empty(&f->ops);
	spin_unlock_irq(&d->lock);
	if (busy && !d->removed) {
		dev_info(&d->vdev->dev, "closed with %u collectives in the device: resetting it\n",
			 f->nops);
		/* The PM path: reset, then negotiate and set up again. */
		virtio_device_freeze(d->vdev);
		d->resets++;
		if (virtio_device_restore(d->vdev))
			dev_err(&d->vdev->dev, "cannot set the device up again after the reset\n");
	}
	list_for_each_entry_safe(op, tmp, &f->ready, node)
		dmlc_reap(f, op, NULL, NULL);
	WARN_ON(!list_empty(&f->ops));
	d->owner = NULL;
	mutex_unlock(&d->open_lock);
	kfree(f);
	kref_put(&d->ref, dmlc_free_dev);
	return 0;
}

static const struct file_operations dmlc_fops = {
	.owner = THIS_MODULE,
	.open = dmlc_open,
	.release = dmlc_release,
	.read = dmlc_read,
	.poll = dmlc_poll,
	.unlocked_ioctl = dmlc_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
#ifdef no_llseek
	/* Gone in 6.12, where a file without .llseek cannot seek at all. */
	.llseek = no_llseek,
#endif
};

static int dmlc_read_config(struct dmlc_dev *d)
{
	struct virtio_device *vdev = d->vdev;

#define DMLC_CREAD32(f) virtio_cread32(vdev, offsetof(struct virtio_dmlc_config, f))
	d->rank = DMLC_CREAD32(rank);
	d->world = DMLC_CREAD32(world_size);
	d->nq = min_t(u32, DMLC_CREAD32(num_queues), DMLC_MAX_QUEUES);
	d->max_segments = DMLC_CREAD32(max_segments);
	d->dtypes = DMLC_CREAD32(dtypes);
	d->ops = DMLC_CREAD32(ops);
	d->opcodes = DMLC_CREAD32(opcodes);
	d->generation = DMLC_CREAD32(generation);
#undef DMLC_CREAD32
	d->max_bytes = virtio_cread64(vdev, offsetof(struct virtio_dmlc_config, max_bytes));
	d->comm = virtio_has_feature(vdev, VIRTIO_DMLC_F_COMM);
	if (d->comm)
		d->max_comms = virtio_cread32(vdev, DMLC_MAX_COMMS_OFFSET);
	if (!d->world || d->rank >= d->world || !d->nq || d->max_segments < 2) {
		dev_err(&vdev->dev, "bad config: rank %u of %u, %u queues, %u segments\n",
			d->rank, d->world, d->nq, d->max_segments);
		return -EINVAL;
	}
	return 0;
}

static int dmlc_probe(struct virtio_device *vdev)
{
	struct dmlc_dev *d;
	int err;

	BUILD_BUG_ON(sizeof(struct virtio_dmlc_req_comm) != 48);
	BUILD_BUG_ON(sizeof(struct virtio_dmlc_resp_comm) != 40);
	BUILD_BUG_ON(DMLC_MAX_COMMS_OFFSET != 0x30);
	BUILD_BUG_ON(offsetof(struct dmlc_req, table) != offsetofend(struct dmlc_req, hdr));
	/*
	 * The ioctl ABI, as driver/src/kernel.rs mirrors it: the fields of
	 * feature bit 1 start where the first version's structs ended.
	 */
	BUILD_BUG_ON(sizeof(struct dmlc_info) != 112);
	BUILD_BUG_ON(offsetof(struct dmlc_info, max_comms) != 104);
	BUILD_BUG_ON(sizeof(struct dmlc_submit) != 184);
	BUILD_BUG_ON(offsetof(struct dmlc_submit, comm) != 136);
	BUILD_BUG_ON(offsetof(struct dmlc_submit, reply) != 160);
	BUILD_BUG_ON(sizeof(struct dmlc_wait) != 96);
	BUILD_BUG_ON(offsetof(struct dmlc_wait, reply) != 72);
	if (!vdev->config->get) {
		dev_err(&vdev->dev, "the transport has no config space access\n");
		return -EINVAL;
	}
	d = kzalloc(sizeof(*d), GFP_KERNEL);
	if (!d)
		return -ENOMEM;
	d->index = ida_alloc(&dmlc_ida, GFP_KERNEL);
	if (d->index < 0) {
		err = d->index;
		kfree(d);
		return err;
	}
	kref_init(&d->ref);
	spin_lock_init(&d->lock);
	mutex_init(&d->open_lock);
	init_waitqueue_head(&d->wq);
	d->vdev = vdev;
	vdev->priv = d;
	err = dmlc_read_config(d);
	if (!err)
		err = dmlc_start(d);
	if (err)
		goto put;
	virtio_device_ready(vdev);
	snprintf(d->name, sizeof(d->name), "dmlc%d", d->index);
	d->misc.minor = MISC_DYNAMIC_MINOR;
	d->misc.name = d->name;
	d->misc.fops = &dmlc_fops;
	d->misc.mode = 0660;
	d->misc.parent = &vdev->dev;
	err = misc_register(&d->misc);
	if (err) {
		dmlc_stop(d, -ENODEV);
		goto put;
	}
	dev_info(&vdev->dev, "/dev/%s: rank %u of %u, %u queues, %u segments, features %#llx\n",
		 d->name, d->rank, d->world, d->nq, d->max_segments, vdev->features);
	return 0;
put:
	kref_put(&d->ref, dmlc_free_dev);
	return err;
}

static void dmlc_remove(struct virtio_device *vdev)
{
	struct dmlc_dev *d = vdev->priv;

	misc_deregister(&d->misc);
	mutex_lock(&d->open_lock);
	d->removed = true;
	dmlc_stop(d, -ENODEV);
	mutex_unlock(&d->open_lock);
	kref_put(&d->ref, dmlc_free_dev);
}

static int dmlc_freeze(struct virtio_device *vdev)
{
	dmlc_stop(vdev->priv, -ECONNRESET);
	return 0;
}

static int dmlc_restore(struct virtio_device *vdev)
{
	int err = dmlc_start(vdev->priv);

	if (!err)
		virtio_device_ready(vdev);
	return err;
}

static const struct virtio_device_id dmlc_id_table[] = {
	{ VIRTIO_ID_DMLC, VIRTIO_DEV_ANY_ID },
	{ 0 },
};

static unsigned int dmlc_features[] = {
	VIRTIO_DMLC_F_REQ_TIMEOUT,
	VIRTIO_DMLC_F_COMM,
	VIRTIO_DMLC_F_P2P,
	VIRTIO_DMLC_F_BLOCKS,
};

/*
 * Before FEATURES_OK: none of bits 1 to 3 with comm=0, and bits 2 and 3
 * only with bit 1 (spec DRV-COMM-1), for a device that offers them
 * without it.
 */
static int dmlc_validate(struct virtio_device *vdev)
{
	if (!dmlc_comm)
		__virtio_clear_bit(vdev, VIRTIO_DMLC_F_COMM);
	if (!virtio_has_feature(vdev, VIRTIO_DMLC_F_COMM)) {
		__virtio_clear_bit(vdev, VIRTIO_DMLC_F_P2P);
		__virtio_clear_bit(vdev, VIRTIO_DMLC_F_BLOCKS);
	}
	return 0;
}

static struct virtio_driver dmlc_driver = {
	.driver.name = KBUILD_MODNAME,
	.driver.owner = THIS_MODULE,
	.feature_table = dmlc_features,
	.feature_table_size = ARRAY_SIZE(dmlc_features),
	.id_table = dmlc_id_table,
	.validate = dmlc_validate,
	.probe = dmlc_probe,
	.remove = dmlc_remove,
	.config_changed = dmlc_config_changed,
	.freeze = dmlc_freeze,
	.restore = dmlc_restore,
};

module_virtio_driver(dmlc_driver);
MODULE_DEVICE_TABLE(virtio, dmlc_id_table);
MODULE_DESCRIPTION("virtio-dmlc allreduce device driver");
MODULE_LICENSE("GPL");
