/* SPDX-License-Identifier: GPL-2.0-only WITH Linux-syscall-note */
/*
 * virtio_dmlc: the ioctl ABI of /dev/dmlcN, the character device of the
 * virtio-dmlc allreduce device (docs/spec.md, docs/kernel-driver.md).
 *
 * Every argument struct starts with argsz (the size the caller knows) and
 * flags. The driver reads min(argsz, its own size) bytes, treats fields the
 * caller does not know as zero, refuses unknown flags with EINVAL, and
 * writes back at most argsz bytes: old binaries keep working when a version
 * adds fields at the end.
 */
#ifndef _UAPI_VIRTIO_DMLC_H
#define _UAPI_VIRTIO_DMLC_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define DMLC_ABI_VERSION 1

/* Bits of dmlc_info.features that this ABI uses (spec 5.X.3). */
#define DMLC_F_REQ_TIMEOUT	0
#define DMLC_F_COMM		1	/* communicators: comm, key, table, reply */
#define DMLC_F_P2P		2	/* send and receive (only with bit 1) */
#define DMLC_F_BLOCKS		3	/* all-to-all, gather, scatter (only with bit 1) */

/* dmlc_submit.peer of a receive from any rank, and of a comm_split color. */
#define DMLC_ANY_SOURCE		0xffffffffu
#define DMLC_UNDEFINED		0xffffffffu	/* comm_split: join no new communicator */

/* The device's config space, as the driver read it, and the file's limits. */
struct dmlc_info {
	__u32 argsz;
	__u32 flags;		/* none defined: 0 */
	__u32 abi_version;	/* DMLC_ABI_VERSION */
	__u32 rank;
	__u32 world_size;
	__u32 num_queues;	/* queues the driver set up */
	__u32 max_segments;
	__u32 dtypes;		/* bit d: dtype d supported */
	__u32 ops;
	__u32 opcodes;
	__u32 generation;	/* read afresh by this call */
	__u32 chunk_bytes;	/* per-block bytes of one device request */
	__u64 group_id;
	__u64 max_bytes;
	__u64 features;		/* negotiated feature bits */
	__u64 pinned_limit;	/* bytes one file may keep pinned */
	__u64 pinned_bytes;	/* pinned now by this file */
	__u64 pinned_total;	/* pinned now by every file of this device */
	__u32 in_flight;	/* collectives of this file not yet reaped */
	__u32 resets;		/* device resets since probe (close mid-collective) */
	/* Added with feature bit 1; older modules leave it 0. */
	__u32 max_comms;	/* live communicators, 0 included (bit 1), else 0 */
	__u32 reserved;
};

/* One user buffer piece. Pieces of a buffer are concatenated in order. */
struct dmlc_iovec {
	__u64 addr;
	__u64 len;
};

/*
 * The outcome of one collective. error is 0 when the device answered:
 * status, detail, peer and generation are then the device's response
 * (spec 5.X.6.7; a collective split into several device requests reports
 * the first that failed, else the last). error is a negative errno when the
 * driver ended it: -ECONNRESET (the device was reset: file closed by another
 * thread, suspend), -ENODEV (device removed), -ENOMEM.
 */
struct dmlc_completion {
	__u64 id;
	__u64 user_data;
	__s32 error;
	__u32 status;
	__u32 detail;
	__u32 peer;
	__u32 generation;
	__u32 requests;		/* device requests it took */
	__u32 written;		/* bytes the device wrote, responses included */
	__u32 reserved;
};

/*
 * What a response of feature bit 1 (VIRTIO_DMLC_F_COMM, spec 5.X.6.13.1)
 * adds to a completion; all 0 without the bit. The sender of a received
 * message is dmlc_completion.peer (a rank of the request's communicator).
 */
struct dmlc_reply {
	__u64 length;		/* send, recv: the message's bytes (TRUNCATE: the other end's) */
	__u32 comm;		/* comm_split, comm_create: the new communicator, 0 if none */
	__u32 comm_rank;	/* this member's rank in it */
	__u32 comm_size;	/* its number of members */
	__u32 peer_world;	/* dmlc_completion.peer as a rank of communicator 0 */
};

/* dmlc_submit.flags */
#define DMLC_SUBMIT_IN_PLACE	0x1u	/* no input: output holds it */
#define DMLC_SUBMIT_WAIT	0x2u	/* block; fill .done */
#define DMLC_SUBMIT_FLAGS	(DMLC_SUBMIT_IN_PLACE | DMLC_SUBMIT_WAIT)

/*
 * Submit one collective on user memory. Buffers need only be aligned to
 * the element size; the driver pins their pages for as long as the device
 * may use them. With DMLC_SUBMIT_WAIT the call returns when the collective
 * is done, spinning up to spin_us on the queue before it sleeps; without
 * it, it returns at once with .id, and the completion is reaped with
 * DMLC_IOC_WAIT or read(). A wait that ends early (ETIMEDOUT, EINTR) leaves
 * the collective submitted: .id is written back first, reap it later.
 *
 * comm to reply came with feature bit 1 (communicators, send and receive,
 * all-to-all, gather, scatter: spec 5.X.6.13); a caller that does not
 * know them gets 0, communicator 0 without a table. They need bit 1 in
 * dmlc_info.features: without it (a device that does not offer it, or
 * module parameter comm=0) a request that sets one of comm, peer, key or
 * table_bytes fails with EOPNOTSUPP. root and peer are ranks of the
 * communicator. The table is copied at submit; table_bytes is at most
 * 16 * world_size (EINVAL). Only requests on communicator 0 without a
 * table are split into several device requests.
 */
struct dmlc_submit {
	__u32 argsz;
	__u32 flags;
	__u16 opcode;
	__u8 dtype;
	__u8 op;
	__u32 root;
	__u64 count;		/* elements per member block */
	__u64 tag;
	__u32 timeout_ms;	/* 0: the device's default */
	__u32 queue;
	__u64 in_iov;		/* user pointer to struct dmlc_iovec[in_cnt] */
	__u64 out_iov;		/* user pointer to struct dmlc_iovec[out_cnt] */
	__u32 in_cnt;
	__u32 out_cnt;
	__u64 user_data;	/* returned in the completion */
	__u32 spin_us;		/* DMLC_SUBMIT_WAIT: busy-poll bound */
	__u32 wait_ms;		/* DMLC_SUBMIT_WAIT: ETIMEDOUT after this, 0: none */
	__u64 id;		/* out */
	struct dmlc_completion done;	/* out, with DMLC_SUBMIT_WAIT */
	__u32 comm;		/* communicator id, 0: the group */
	__u32 peer;		/* send: destination; recv: source; comm_split: color */
	__u32 key;		/* comm_split: key; otherwise 0 */
	__u32 table_bytes;	/* bytes at table (spec 5.X.6.13.5) */
	__u64 table;		/* user pointer to the table: le64 counts or le32 ranks */
	struct dmlc_reply reply;	/* out, with DMLC_SUBMIT_WAIT */
};

/* dmlc_wait.flags */
#define DMLC_WAIT_PEEK		0x1u	/* EAGAIN unless done; reap nothing */
#define DMLC_WAIT_FLAGS		DMLC_WAIT_PEEK

/*
 * Wait for one submitted collective and reap it. read() reaps the same
 * records without reply: reap with this call the collectives whose reply
 * is wanted (a receive's length, a new communicator).
 */
struct dmlc_wait {
	__u32 argsz;
	__u32 flags;
	__u64 id;
	__u32 timeout_ms;	/* 0: no limit (ETIMEDOUT after it) */
	__u32 spin_us;
	struct dmlc_completion done;	/* out */
	struct dmlc_reply reply;	/* out (feature bit 1) */
};

#define DMLC_IOC_MAGIC	0xd3
#define DMLC_IOC_INFO	_IO(DMLC_IOC_MAGIC, 0x00)	/* struct dmlc_info */
#define DMLC_IOC_SUBMIT	_IO(DMLC_IOC_MAGIC, 0x01)	/* struct dmlc_submit */
#define DMLC_IOC_WAIT	_IO(DMLC_IOC_MAGIC, 0x02)	/* struct dmlc_wait */

#endif /* _UAPI_VIRTIO_DMLC_H */
