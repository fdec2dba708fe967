/*
 * dmlc_guest.h - C interface of the virtio-dmlc userspace driver.
 *
 * The virtio-dmlc device performs collectives (allreduce, broadcast, reduce,
 * allgather, reduce-scatter, barrier) among the members of a group, reading
 * and writing the members' buffers directly; with feature bits 1 to 3 also
 * on communicators (subsets of the group), with send and receive,
 * all-to-all, gather and scatter (see "Communicators" below). This library drives the device
 * from userspace. Link with -ldmlc_guest (libdmlc_guest.so or .a, built by
 * `cargo build -p dmlc-capi`; the static library also needs -lpthread -ldl
 * -lm).
 *
 * Conventions:
 *  - Functions returning int return a dmlc_status: DMLC_OK (0) or an error.
 *    On error, dmlc_last_error_message() gives a one-line description.
 *  - Every pointer argument is checked: NULL where not allowed gives
 *    DMLC_ERR_INVALID_ARGUMENT. No function aborts the process.
 *  - Collectives are matched across members by order: the k-th collective
 *    issued on a queue by every member forms one collective (per
 *    communicator: see "Communicators" below). All members must
 *    issue the same sequence (same opcode, dtype, op, count, root, tag).
 *  - Data passed to the blocking collectives lives in dmlc_buffer objects:
 *    device-visible memory that the device reads and writes in place, with no
 *    copy. dmlc_allreduce_host works on ordinary memory through a bounce
 *    buffer (one copy in and one copy out).
 *  - A dmlc_device may be used from several threads at once. A buffer must
 *    not be modified while a collective that uses it is in flight.
 *  - The numbers of dtypes, ops, opcodes and statuses are those of the
 *    device ABI (docs/spec.md; crate virtio-dmlc).
 *
 * C99. All functions are thread-safe unless noted.
 */
#ifndef DMLC_GUEST_H
#define DMLC_GUEST_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Version ----------------------------------------------------------------
 * The ABI of this header: raised whenever a function, struct, constant or
 * status changes meaning. A program (or a binding such as the Python
 * package) checks dmlc_abi_version() == DMLC_ABI_VERSION when it loads the
 * library, and refuses a library of another ABI. Additions that leave
 * every existing call as it was do not raise it (a program of the same ABI
 * built before them runs unchanged): communicators, send and receive,
 * all-to-all, gather and scatter (dmlc_comm_*, dmlc_send, ...) came so;
 * DMLC_ERR_TRUNCATE and DMLC_MISMATCH_TABLE arise only from them; and
 * the check of non-finite inputs (dmlc_set_check_finite,
 * DMLC_CHECK_FINITE), off unless asked for, whose DMLC_ERR_NONFINITE
 * arises only with it; and dmlc_set_tag, tag 0 unless called. */
#define DMLC_ABI_VERSION 1u

/* The library's ABI version (DMLC_ABI_VERSION of the header it was built
 * with). */
uint32_t dmlc_abi_version(void);

/* The library's release ("0.1.0"): static text, never NULL. */
const char *dmlc_version(void);

/* ---- Status codes -------------------------------------------------------
 * 0..9 are the device's response statuses (VirtioDmlcResp.status; 8 only
 * from send and receive, 9 only with dmlc_set_check_finite);
 * 100 and up are the driver's own errors. */
typedef enum dmlc_status {
    DMLC_OK = 0,                   /* completed; outputs hold the result */
    DMLC_ERR_BAD_REQUEST = 1,      /* malformed request (sizes, root, flags) */
    DMLC_ERR_MISMATCH = 2,         /* members disagree on this collective */
    DMLC_ERR_PEER_LOST = 3,        /* a member was lost during the collective */
    DMLC_ERR_TIMEOUT = 4,          /* not every member arrived in time */
    DMLC_ERR_UNSUPPORTED = 5,      /* opcode, dtype or op not supported */
    DMLC_ERR_TOO_BIG = 6,          /* above max_bytes or max_segments */
    DMLC_ERR_RESET = 7,            /* the group was reset meanwhile */
    DMLC_ERR_TRUNCATE = 8,         /* a message was larger than its receive (above
                                    * max_bytes: of another size; see dmlc_recv) */
    DMLC_ERR_NONFINITE = 9,        /* with dmlc_set_check_finite: an input held a NaN or an
                                    * infinity; peer: the lowest such rank,
                                    * dmlc_last_error_length(): its lowest such element;
                                    * the outputs hold the result all the same */

    DMLC_ERR_INVALID_ARGUMENT = 100, /* NULL pointer, bad queue, buffer too small, ... */
    DMLC_ERR_NO_STATUS = 101,        /* device returned the request without a status */
    DMLC_ERR_UNKNOWN_STATUS = 102,   /* device returned a status this driver does not know */
    DMLC_ERR_WAIT_TIMEOUT = 103,     /* dmlc_wait gave up; the request is still pending */
    DMLC_ERR_QUEUE_FULL = 104,       /* no free descriptors; wait for a request first */
    DMLC_ERR_OUT_OF_MEMORY = 105,    /* device-visible memory exhausted */
    DMLC_ERR_UNKNOWN_HANDLE = 106,   /* handle already completed or of another device */
    DMLC_ERR_TRANSPORT = 107,        /* connection to the device failed or was lost */
    DMLC_ERR_DEVICE = 108,           /* the device misbehaved (config, ring protocol) */
    DMLC_ERR_INTERNAL = 109,         /* internal driver error (caught panic) */
    DMLC_ERR_UNANSWERED = 110,       /* no answer within the device's timeout plus a margin:
                                      * the device is stuck or gone; the request stays in
                                      * flight until the device is reset; reopen it */
    DMLC_ERR_REQUEST_DROPPED = 111,  /* the backend restarted (its group id changed) and will
                                      * never answer this request; reopen the device */
    DMLC_ERR_BUFFER_BUSY = 112,      /* a request in flight uses the buffer (wait for it) */
    DMLC_ERR_ENVIRONMENT = 113       /* the job's environment is wrong or names no device */
} dmlc_status;

/* ---- Element types (VirtioDmlcReq.dtype) ---- */
typedef enum dmlc_dtype {
    DMLC_DTYPE_F32 = 0,
    DMLC_DTYPE_F64 = 1,
    DMLC_DTYPE_F16 = 2,  /* IEEE binary16; reduced with f32 accumulation */
    DMLC_DTYPE_BF16 = 3, /* bfloat16; reduced with f32 accumulation */
    DMLC_DTYPE_I8 = 4,
    DMLC_DTYPE_U8 = 5,
    DMLC_DTYPE_I32 = 6,
    DMLC_DTYPE_U32 = 7,
    DMLC_DTYPE_I64 = 8,
    DMLC_DTYPE_U64 = 9
} dmlc_dtype;

/* ---- Reduce operations (VirtioDmlcReq.op) ---- */
typedef enum dmlc_op {
    DMLC_OP_SUM = 0,  /* integers wrap */
    DMLC_OP_PROD = 1, /* integers wrap */
    DMLC_OP_MIN = 2,  /* floats: NaN in any input gives NaN */
    DMLC_OP_MAX = 3,
    DMLC_OP_AVG = 4,  /* sum / world size; integers truncate toward zero */
    DMLC_OP_BAND = 5, /* bitwise ops: integer dtypes only */
    DMLC_OP_BOR = 6,
    DMLC_OP_BXOR = 7
} dmlc_op;

/* ---- Collectives (VirtioDmlcReq.opcode) ---- */
typedef enum dmlc_opcode {
    DMLC_OPCODE_ALLREDUCE = 0,
    DMLC_OPCODE_BROADCAST = 1,
    DMLC_OPCODE_REDUCE = 2,
    DMLC_OPCODE_ALLGATHER = 3,
    DMLC_OPCODE_REDUCE_SCATTER = 4,
    DMLC_OPCODE_BARRIER = 5,
    DMLC_OPCODE_NOP = 6, /* answered at once for this member alone */
    /* Feature bits 1 to 3 (spec 5.X.6.13.2; see "Communicators" below): only
     * through dmlc_comm_call and the functions of that section. */
    DMLC_OPCODE_SEND = 7,
    DMLC_OPCODE_RECV = 8,
    DMLC_OPCODE_ALLTOALL = 9,
    DMLC_OPCODE_ALLTOALLV = 10,
    DMLC_OPCODE_GATHER = 11,
    DMLC_OPCODE_GATHERV = 12,
    DMLC_OPCODE_SCATTER = 13,
    DMLC_OPCODE_SCATTERV = 14,
    DMLC_OPCODE_COMM_SPLIT = 15,
    DMLC_OPCODE_COMM_CREATE = 16,
    DMLC_OPCODE_COMM_FREE = 17
} dmlc_opcode;

/* VirtioDmlcReq.flags: in place (no input segments; see each collective). */
#define DMLC_FLAG_IN_PLACE 1u
/* dmlc_completion.peer when no member is concerned. */
#define DMLC_NO_PEER 0xffffffffu

/* Communicators (spec 5.X.6.13). The whole group, in rank order. */
#define DMLC_COMM_WORLD 0u
/* dmlc_recv's peer: a message from whichever member sends first. */
#define DMLC_ANY_SOURCE 0xffffffffu
/* dmlc_comm_split's color: this member joins no new communicator. */
#define DMLC_UNDEFINED 0xffffffffu
/* dmlc_comm_features bits: the device's feature bits 1 to 3. */
#define DMLC_FEATURE_COMM (1u << 1)   /* communicators (comm_split, comm_create, comm_free) */
#define DMLC_FEATURE_P2P (1u << 2)    /* send and receive */
#define DMLC_FEATURE_BLOCKS (1u << 3) /* all-to-all, gather, scatter and their v forms */
/* The device's details of these requests' failures (dmlc_completion.detail). */
#define DMLC_BAD_COMM 14u            /* BAD_REQUEST: unknown, freed or foreign communicator,
                                      * or freeing communicator 0 */
#define DMLC_BAD_PEER 15u            /* BAD_REQUEST: a send's or receive's peer is this
                                      * member or not a rank of the communicator */
#define DMLC_BAD_TABLE 16u           /* BAD_REQUEST: a table of the wrong size, or a bad
                                      * comm_create list */
#define DMLC_BAD_IN_PLACE_OPCODE 17u /* BAD_REQUEST: in place on send, recv or alltoall(v) */
#define DMLC_MISMATCH_TABLE 0x40u    /* MISMATCH mask bit: the members' tables disagree */
#define DMLC_TOO_BIG_COMMS 3u        /* TOO_BIG: the device's max_comms communicators live */

/* ---- Objects ---- */

/* An open device (one member of a group). */
typedef struct dmlc_device dmlc_device;
/* A buffer in device-visible memory. Holds a reference to its device. */
typedef struct dmlc_buffer dmlc_buffer;
/* A submitted, not yet completed request (see dmlc_submit). */
typedef struct dmlc_handle dmlc_handle;

/* Device configuration (the device's config space, decoded). */
typedef struct dmlc_config {
    uint32_t rank;         /* this member's rank, 0..world_size-1 */
    uint32_t world_size;   /* members in the group */
    uint32_t num_queues;   /* request queues */
    uint32_t max_segments; /* largest number of data segments per request */
    uint64_t max_bytes;    /* largest input or output of one request */
    uint32_t dtypes;       /* bit d set: dtype d supported */
    uint32_t ops;          /* bit o set: op o supported */
    uint32_t opcodes;      /* bit c set: opcode c supported */
    uint32_t generation;   /* changes when the group resets */
    uint64_t group_id;
} dmlc_config;

/* Options of dmlc_open_host_ex; fill with dmlc_open_options_init first. */
/* Values of dmlc_open_options.poll (and of dmlc_open_host's poll). */
#define DMLC_WAIT_INTERRUPT 0 /* sleep on the device's interrupt */
#define DMLC_WAIT_POLL 1      /* busy-poll (so does any value but 0 and 2) */
#define DMLC_WAIT_HYBRID 2    /* spin up to 200 us while recent waits ended within it, then sleep */

typedef struct dmlc_open_options {
    int poll;            /* DMLC_WAIT_HYBRID (default), DMLC_WAIT_POLL or DMLC_WAIT_INTERRUPT */
    uint16_t queue_size; /* descriptors per queue (power of two) */
    int event_idx;       /* nonzero: negotiate VIRTIO_RING_F_EVENT_IDX */
    uint64_t dma_bytes;  /* device-visible memory to reserve for buffers */
} dmlc_open_options;

/* A request header for dmlc_submit (the fields of VirtioDmlcReq). */
typedef struct dmlc_request {
    uint16_t opcode;     /* dmlc_opcode */
    uint8_t dtype;       /* dmlc_dtype (ignored by barrier) */
    uint8_t op;          /* dmlc_op (allreduce, reduce, reduce-scatter) */
    uint32_t root;       /* broadcast and reduce; 0 otherwise */
    uint64_t count;      /* elements per member block */
    uint64_t tag;        /* must be equal on every member */
    uint32_t flags;      /* DMLC_FLAG_* */
    uint32_t timeout_ms; /* 0: device default */
} dmlc_request;

/* A piece of a buffer: bytes [offset, offset + len) of buf. */
typedef struct dmlc_segment {
    const dmlc_buffer *buf;
    size_t offset;
    size_t len;
} dmlc_segment;

/* What dmlc_wait reports about a request, success or not. */
typedef struct dmlc_completion {
    int status;          /* same as dmlc_wait's return value */
    uint32_t detail;     /* device detail: BAD_* reason, mismatch field mask, ... */
    uint32_t peer;       /* rank the status is about, or DMLC_NO_PEER */
    uint32_t generation; /* group generation that completed it (0 if unknown) */
} dmlc_completion;

/* ---- Opening and closing ---- */

/* Fills *opts with the defaults (hybrid wait, queue size 256, event idx, 256 MiB). */
void dmlc_open_options_init(dmlc_open_options *opts);

/* Opens the device served by the vhost-user backend at `socket` (the host
 * transport: this process plays the VM). `poll` is a DMLC_WAIT_* value: how
 * a wait for a completion spends its time. */
int dmlc_open_host(const char *socket, int poll, dmlc_device **out);

/* As dmlc_open_host, with every option. */
int dmlc_open_host_ex(const char *socket, const dmlc_open_options *opts, dmlc_device **out);

/* Opens the virtio-dmlc PCI device from inside a guest (the PCI transport):
 * `addr` is its PCI address ("0000:00:03.0"), NULL for the first one. Needs
 * root and opts->dma_bytes of free 2 MiB hugepages (docs/qemu.md). */
int dmlc_open_pci(const char *addr, const dmlc_open_options *opts, dmlc_device **out);

/* Opens the device through the virtio_dmlc kernel module from inside a
 * guest (kernel-driver/, docs/kernel-driver.md): `node` is its device node,
 * NULL for /dev/dmlc0. Needs no root and no hugepages, only read and write
 * access to the node; opts->dma_bytes is ordinary memory. */
int dmlc_open_kernel(const char *node, const dmlc_open_options *opts, dmlc_device **out);

/* Opens the device the job's environment names, the way every client does
 * (the rabit API, the Python package, its torch backend): DMLC_SOCKET (a
 * backend socket), DMLC_SOCKET_PREFIX (plus the rank), DMLC_DEVICE=pci[:ADDR]
 * or kernel[:NODE]; DMLC_POLL (hybrid, the default, spins, then sleeps;
 * poll or 1 busy-polls; interrupt or 0 sleeps at once), DMLC_DMA_BYTES ("256M"); a rank and size from the launcher
 * (DMLC_TASK_ID, DMLC_NUM_WORKER) or torchrun (RANK, WORLD_SIZE) must be the
 * device's. `env` is NULL for the process environment, or a NULL-terminated
 * array of "NAME=VALUE" strings. Settings that cannot work give
 * DMLC_ERR_ENVIRONMENT; a device that cannot be opened, its own status. */
int dmlc_open_env(const char *const *env, dmlc_device **out);

/* 1 if collectives reach the caller's own memory without a copy (the kernel
 * transport, where dmlc_wrap_memory works), 0 if not; -1 if dev is NULL. */
int dmlc_reaches_any_memory(const dmlc_device *dev);

/* Bytes per request of the host forms (dmlc_*_host), the same on every
 * member: longer data is cut into pieces of this size (allgather and
 * reduce-scatter: this size over world_size per member; the forms on
 * ordinary memory of "Communicators" below: as that section says). A client that
 * sends device memory directly must cut at the same places for its requests
 * to pair with those of a member using the host forms. 0 if dev is NULL. */
uint64_t dmlc_host_chunk_bytes(const dmlc_device *dev);

/* Non-finite origin (spec 5.X.6.14, device feature bit 4): with `on` != 0,
 * every later floating-point reduction (allreduce, reduce, reduce_scatter,
 * host forms and communicators included) is checked: if any member's input
 * holds a NaN or an infinity, it fails with DMLC_ERR_NONFINITE, the lowest
 * such rank (of the request's communicator) in the completion's peer and
 * dmlc_last_error_completion's, the lowest such element of its input in
 * dmlc_last_error_length() (for the host forms, counted in the caller's
 * whole buffer); the outputs hold the result as without the check. Other
 * requests are unchanged. dmlc_open_env turns it on for DMLC_CHECK_FINITE=1.
 * DMLC_ERR_INVALID_ARGUMENT if the device lacks bit 4 (a group across hosts,
 * the kernel driver) or dev is NULL. */
int dmlc_set_check_finite(dmlc_device *dev, int on);

/* Tags the later collectives of dev that name tag 0 with `tag` (0: none),
 * e.g. a trainer's step number, which `dmlc-ctl freeze --tag` can name
 * (docs/debugging.md). Every member must set the same tag for a collective
 * (the device compares it: DMLC_ERR_MISMATCH otherwise). Sends, receives
 * and dmlc_comm_create keep their own tag. DMLC_ERR_INVALID_ARGUMENT if dev
 * is NULL. */
int dmlc_set_tag(dmlc_device *dev, uint64_t tag);

/* How waits spend their time on this device: DMLC_WAIT_INTERRUPT,
 * DMLC_WAIT_POLL or DMLC_WAIT_HYBRID (a hybrid wait on a transport with no
 * interrupt to sleep on polls); -1 if dev is NULL. */
int dmlc_wait_mode(const dmlc_device *dev);

/* Closes the device. Buffers still allocated keep the device's memory alive
 * until they are freed. Pending handles must be waited for first. NULL is a
 * no-op. */
void dmlc_close(dmlc_device *dev);

/* Rank, world size, number of queues; -1 if dev is NULL. */
int32_t dmlc_rank(const dmlc_device *dev);
int32_t dmlc_world_size(const dmlc_device *dev);
int32_t dmlc_num_queues(const dmlc_device *dev);

/* Re-reads the config space (the generation may change). */
int dmlc_get_config(const dmlc_device *dev, dmlc_config *out);

/* Size in bytes of one element of `dtype`, or 0 if unknown. */
size_t dmlc_dtype_size(int dtype);

/* ---- Device-visible buffers ---- */

/* Allocates `bytes` (> 0) of device-visible memory, zero-filled. */
int dmlc_alloc(dmlc_device *dev, size_t bytes, dmlc_buffer **out);
/* Wraps the caller's own `bytes` (> 0) at `data` as a buffer, without a
 * copy: only over the kernel transport (dmlc_open_kernel), whose module
 * pins those pages for each request; elsewhere DMLC_ERR_INVALID_ARGUMENT
 * (allocate with dmlc_alloc and copy). The memory stays the caller's: it
 * must stay valid until the buffer is freed and no request using it is
 * pending, and must not be touched while a request writes it. dmlc_free
 * releases the wrapper only. */
int dmlc_wrap_memory(dmlc_device *dev, void *data, size_t bytes, dmlc_buffer **out);
/* Frees a buffer. NULL is a no-op. */
void dmlc_free(dmlc_buffer *buf);
/* The buffer's memory and size; NULL / 0 if buf is NULL. */
void *dmlc_buffer_data(const dmlc_buffer *buf);
size_t dmlc_buffer_size(const dmlc_buffer *buf);

/* ---- Blocking collectives on device-visible buffers (queue 0) ----
 * Data starts at offset 0 of each buffer; a buffer may be larger than
 * needed. `send == NULL` or `send == recv` means in place. */

/* recv[i] = reduction over members of send[i], i < count. In place: recv
 * holds this member's input. */
int dmlc_allreduce(dmlc_device *dev, const dmlc_buffer *send, dmlc_buffer *recv, uint64_t count,
                   int dtype, int op);

/* recv = root's send (count elements). `send` is used on the root only (in
 * place there if NULL or recv); other members may pass NULL. */
int dmlc_broadcast(dmlc_device *dev, const dmlc_buffer *send, dmlc_buffer *recv, uint64_t count,
                   int dtype, uint32_t root);

/* root's recv = reduction of every member's send. Non-root members may pass
 * recv = NULL. In place (send NULL): recv holds the input on every member
 * (non-root buffers are read, not written). */
int dmlc_reduce(dmlc_device *dev, const dmlc_buffer *send, dmlc_buffer *recv, uint64_t count,
                int dtype, int op, uint32_t root);

/* recv (world_size * sendcount elements) = every member's send in rank
 * order. In place: this member's input is at recv + rank * sendcount. */
int dmlc_allgather(dmlc_device *dev, const dmlc_buffer *send, dmlc_buffer *recv, uint64_t sendcount,
                   int dtype);

/* send has world_size * recvcount elements; member r gets block r of the
 * reduction in recv. In place: recv holds the whole input, and block `rank`
 * of it receives the result. */
int dmlc_reduce_scatter(dmlc_device *dev, const dmlc_buffer *send, dmlc_buffer *recv,
                        uint64_t recvcount, int dtype, int op);

/* Returns once every member has called it. */
int dmlc_barrier(dmlc_device *dev);

/* Allreduce on ordinary memory through an internal bounce buffer: recv[i] =
 * reduction of send[i]. send == NULL or send == recv: in place on recv;
 * otherwise send and recv must not overlap. Data longer than the chunk size
 * (the smaller of max_bytes and 16 MiB) runs as several requests, cut at the
 * same places on every member. */
int dmlc_allreduce_host(dmlc_device *dev, const void *send, void *recv, uint64_t count, int dtype,
                        int op);

/* The other collectives on ordinary memory, through the same bounce buffer
 * and cut at the same places on every member. */

/* data (count elements) = the root's data. */
int dmlc_broadcast_host(dmlc_device *dev, void *data, uint64_t count, int dtype, uint32_t root);

/* The root's data = reduction of every member's data; the others' data is
 * unchanged. */
int dmlc_reduce_host(dmlc_device *dev, void *data, uint64_t count, int dtype, int op,
                     uint32_t root);

/* recv (world_size * sendcount elements) = every member's send in rank
 * order; send and recv must not overlap. */
int dmlc_allgather_host(dmlc_device *dev, const void *send, void *recv, uint64_t sendcount,
                        int dtype);

/* recv (recvcount elements) = block `rank` of the reduction of every
 * member's send (world_size * recvcount elements); no overlap. */
int dmlc_reduce_scatter_host(dmlc_device *dev, const void *send, void *recv, uint64_t recvcount,
                             int dtype, int op);

/* ---- Non-blocking requests ---- */

/* Posts `req` on `queue` with the given input and output segments (see the
 * device spec for the lengths each opcode needs) and returns at once.
 * *handle must later be passed to dmlc_wait. */
int dmlc_submit(dmlc_device *dev, uint16_t queue, const dmlc_request *req, const dmlc_segment *inputs,
                size_t n_inputs, const dmlc_segment *outputs, size_t n_outputs, dmlc_handle **handle);

/* Waits for a submitted request. timeout_ms < 0 waits forever. Returns the
 * request's status; on DMLC_ERR_WAIT_TIMEOUT the handle stays valid (call
 * dmlc_wait again), otherwise it is consumed. `out` may be NULL. */
int dmlc_wait(dmlc_device *dev, dmlc_handle *handle, int64_t timeout_ms, dmlc_completion *out);

/* ---- Communicators, send and receive, all-to-all, gather and scatter ----
 * Spec 5.X.6.13, feature bits 1 to 3 of the device (dmlc_comm_features):
 * offered by the reference daemon to the members of a group on one host,
 * not across hosts (--mpi) and not over the kernel transport.
 *
 * A communicator is an ordered subset of the group's members with an id;
 * DMLC_COMM_WORLD (0) is the whole group. Every function here names one
 * explicitly (there is no "current communicator": a device is shared by
 * threads, and the k-th collective of a queue is matched per communicator,
 * so hidden state would make the matching depend on which thread set it
 * last). Ranks and roots are ranks of the named communicator, counts and
 * buffer sizes use its size. The collectives of a communicator are matched
 * by order among the requests that name it (its own sequence numbers);
 * those of different communicators are independent. Members outside a
 * communicator take no part in its collectives.
 *
 * Three ways to run a request on a communicator:
 *  - dmlc_comm_call: any opcode, on device buffers (dmlc_segment, no copy),
 *    blocking; dmlc_submit_comm: the collectives of dmlc_request (opcodes 0
 *    to 6) on device buffers, non-blocking (dmlc_wait).
 *  - On ordinary memory through a staging buffer (one copy in, one out):
 *    dmlc_send, dmlc_recv, dmlc_alltoall, ... below (these operations have
 *    only this form and dmlc_comm_call, hence no _host suffix), and
 *    dmlc_*_host_comm / dmlc_barrier_comm for the collectives (on
 *    DMLC_COMM_WORLD these are the dmlc_*_host functions themselves).
 *  - dmlc_comm_split, dmlc_comm_create, dmlc_comm_free for communicators.
 *
 * Where the forms on ordinary memory cut data into several requests, every
 * member cuts at the same places, so a member using them pairs with one
 * that sends device buffers cut the same way:
 *  - send and receive: a message larger than the device's max_bytes is
 *    several messages of P = max_bytes rounded down to whole elements, the
 *    last shorter, sent in order with the same tag (spec 5.X.6.13.4,
 *    DRV-COMM-2). A receive of more than P bytes must give room equal to
 *    the message's size (as torch's send and recv do): with another room
 *    the first piece of another size fails with DMLC_ERR_TRUNCATE on the
 *    receive (and the send, if it was larger), or the receive waits for a
 *    piece that never comes and fails with DMLC_ERR_TIMEOUT. Each piece
 *    needs min(message, P) bytes of device-visible memory
 *    (dmlc_open_options.dma_bytes; the daemon's default max_bytes is 1 GiB).
 *  - the collectives and alltoall, gather and scatter: as the host forms cut
 *    the group's (dmlc_host_chunk_bytes; the block collectives that many
 *    bytes per request over the communicator's size per block).
 *  - the v forms (alltoallv, gatherv, scatterv): not cut, one request each
 *    (a member knows only its own counts, so the members could not agree on
 *    pieces): each member's input and output must fit max_bytes
 *    (DMLC_ERR_TOO_BIG before anything is sent otherwise; the others then
 *    wait until their timeout).
 * Send and receive are synchronous: dmlc_send returns once a receive took
 * the message, so two members that each send to the other first wait for
 * each other until the timeout. Sends and receives of one thread run one
 * at a time; use threads (or the device's queues through dmlc_comm_call)
 * to have several pending. The functions on ordinary memory use queue 0. */

/* A communicator as this member knows it. */
typedef struct dmlc_comm_info {
    uint32_t id;   /* 0: the group (or, from dmlc_comm_split, none) */
    uint32_t rank; /* this member's rank in it */
    uint32_t size; /* its number of members */
} dmlc_comm_info;

/* A request of any opcode for dmlc_comm_call: the fields of dmlc_request,
 * then those of the device's 48-byte header (virtio_dmlc_req_comm). */
typedef struct dmlc_comm_request {
    uint16_t opcode;      /* dmlc_opcode, 0 to 17 */
    uint8_t dtype;        /* dmlc_dtype (ignored by barrier and comm_*) */
    uint8_t op;           /* dmlc_op (allreduce, reduce, reduce-scatter) */
    uint32_t root;        /* broadcast, reduce, gather(v), scatter(v); 0 otherwise */
    uint64_t count;       /* elements, as the spec's tables of buffer sizes say */
    uint64_t tag;
    uint32_t flags;       /* DMLC_FLAG_* */
    uint32_t timeout_ms;  /* 0: device default */
    uint32_t comm;        /* the communicator */
    uint32_t peer;        /* send: destination; recv: source or DMLC_ANY_SOURCE;
                           * comm_split: color or DMLC_UNDEFINED; otherwise 0 */
    uint32_t key;         /* comm_split: the key ordering the new communicator */
    uint32_t table_bytes; /* bytes at table */
    const void *table;    /* as the device reads it (spec 5.X.6.13.5): le64 counts
                           * (alltoallv: send[N] then recv[N]; gatherv, scatterv:
                           * the root's N), or comm_create's le32 ranks; NULL if 0 */
} dmlc_comm_request;

/* What dmlc_comm_call reports: dmlc_completion's fields, then those of the
 * device's 40-byte response (virtio_dmlc_resp_comm). */
typedef struct dmlc_comm_completion {
    int status;          /* same as dmlc_comm_call's return value */
    uint32_t detail;
    uint32_t peer;       /* recv: the sender; a failure: the rank concerned */
    uint32_t generation;
    uint64_t length;     /* send, recv: the message's bytes; on DMLC_ERR_TRUNCATE
                          * the other end's size (send: the receive's room) */
    uint32_t comm;       /* comm_split, comm_create: the new communicator (0: none) */
    uint32_t comm_rank;  /* this member's rank in it */
    uint32_t comm_size;  /* its size */
    uint32_t peer_world; /* peer as a rank of the group (DMLC_NO_PEER if none or,
                          * for a failure on a communicator other than 0, unknown) */
} dmlc_comm_completion;

/* DMLC_FEATURE_* bits of the features the device offered and this library
 * negotiated (0: none, a device of 5.X.6.1 only); -1 if dev is NULL. */
int dmlc_comm_features(const dmlc_device *dev);

/* Most communicators alive at once, the group's included (the device's
 * max_comms); 0 without communicators, -1 if dev is NULL. */
int32_t dmlc_max_comms(const dmlc_device *dev);

/* Communicator `comm` as this member knows it (made by dmlc_comm_split or
 * dmlc_comm_create and not freed): DMLC_ERR_BAD_REQUEST (DMLC_BAD_COMM)
 * otherwise. *out is zeroed first. */
int dmlc_get_comm_info(const dmlc_device *dev, uint32_t comm, dmlc_comm_info *out);

/* Collective over `comm`: every color other than DMLC_UNDEFINED makes a new
 * communicator of the members that gave it, ranked by key, then by rank in
 * `comm`. *out is the new communicator, or all 0 for DMLC_UNDEFINED. */
int dmlc_comm_split(dmlc_device *dev, uint32_t comm, uint32_t color, uint32_t key,
                    dmlc_comm_info *out);

/* A new communicator of ranks[0..n) of `comm` (distinct, this member among
 * them), in its rank order, called by those members only (the others of
 * `comm` need not know). `tag` tells creations of one `comm` apart; those
 * with the same tag are matched in order. */
int dmlc_comm_create(dmlc_device *dev, uint32_t comm, const uint32_t *ranks, size_t n,
                     uint64_t tag, dmlc_comm_info *out);

/* Collective over `comm`: its id stops being valid. Not DMLC_COMM_WORLD. */
int dmlc_comm_free(dmlc_device *dev, uint32_t comm);

/* dmlc_submit on communicator `comm` (opcodes 0 to 6, root a rank of it). */
int dmlc_submit_comm(dmlc_device *dev, uint16_t queue, uint32_t comm, const dmlc_request *req,
                     const dmlc_segment *inputs, size_t n_inputs, const dmlc_segment *outputs,
                     size_t n_outputs, dmlc_handle **handle);

/* Posts any request on `queue` with the given segments (device buffers, no
 * copy; lengths as the spec's tables say) and waits for it; the wait ends,
 * at the latest, with DMLC_ERR_UNANSWERED after the request's timeout plus a
 * margin. `out` may be NULL. */
int dmlc_comm_call(dmlc_device *dev, uint16_t queue, const dmlc_comm_request *req,
                   const dmlc_segment *inputs, size_t n_inputs, const dmlc_segment *outputs,
                   size_t n_outputs, dmlc_comm_completion *out);

/* Sends `count` elements at buf to rank `peer` of `comm`, matched by `tag`
 * (in order per sender, receiver and tag); returns once the receiver has
 * them. DMLC_ERR_TRUNCATE: the receive's room was smaller (nothing of that
 * piece moved); dmlc_last_error_length() gives the room. */
int dmlc_send(dmlc_device *dev, uint32_t comm, uint32_t peer, uint64_t tag, int dtype,
              const void *buf, uint64_t count);

/* Receives one message from rank `peer` of `comm` (or DMLC_ANY_SOURCE) with
 * `tag` into buf, room for `count` elements; a shorter message leaves the
 * rest of buf as it was. *length (bytes) and *source (the sender's rank in
 * `comm`) are set on DMLC_OK and on DMLC_ERR_TRUNCATE (the message's size as
 * far as known: larger than the room), 0 and DMLC_NO_PEER otherwise; either
 * may be NULL. */
int dmlc_recv(dmlc_device *dev, uint32_t comm, uint32_t peer, uint64_t tag, int dtype, void *buf,
              uint64_t count, uint64_t *length, uint32_t *source);

/* recv[j*count + i] = send_j[r*count + i]: block j of every member's send
 * (size * count elements, size the communicator's) goes to member j, whose
 * recv holds every member's block in rank order. No overlap. */
int dmlc_alltoall(dmlc_device *dev, uint32_t comm, const void *send, void *recv, uint64_t count,
                  int dtype);

/* As dmlc_alltoall with sendcounts[j] elements to member j and
 * recvcounts[i] from member i (size entries each; member i's sendcounts[j]
 * must equal member j's recvcounts[i]), blocks one after the other in rank
 * order. One request. */
int dmlc_alltoallv(dmlc_device *dev, uint32_t comm, const void *send, void *recv,
                   const uint64_t *sendcounts, const uint64_t *recvcounts, int dtype);

/* The root's recv (size * count elements) gets every member's send (count
 * elements) in rank order; recv is used on the root only. In place at the
 * root: send NULL, its input already in block `root` of recv. */
int dmlc_gather(dmlc_device *dev, uint32_t comm, const void *send, void *recv, uint64_t count,
                int dtype, uint32_t root);

/* As dmlc_gather, each member giving its own count; the root's recvcounts
 * (size entries; entry j member j's count) place the blocks. recv and
 * recvcounts are used on the root only. One request. */
int dmlc_gatherv(dmlc_device *dev, uint32_t comm, const void *send, void *recv, uint64_t count,
                 const uint64_t *recvcounts, int dtype, uint32_t root);

/* Every member's recv (count elements) gets its block of the root's send
 * (size * count elements, used on the root only). At the root recv may be
 * NULL (its block stays in send). */
int dmlc_scatter(dmlc_device *dev, uint32_t comm, const void *send, void *recv, uint64_t count,
                 int dtype, uint32_t root);

/* As dmlc_scatter, each member receiving its own count; the root's
 * sendcounts (size entries) place the blocks in send. send and sendcounts
 * are used on the root only. One request. */
int dmlc_scatterv(dmlc_device *dev, uint32_t comm, const void *send, void *recv,
                  const uint64_t *sendcounts, uint64_t count, int dtype, uint32_t root);

/* The collectives on ordinary memory on communicator `comm`, as the
 * dmlc_*_host functions (which they are on DMLC_COMM_WORLD); sizes and
 * roots are the communicator's. */
int dmlc_allreduce_host_comm(dmlc_device *dev, uint32_t comm, const void *send, void *recv,
                             uint64_t count, int dtype, int op);
int dmlc_broadcast_host_comm(dmlc_device *dev, uint32_t comm, void *data, uint64_t count,
                             int dtype, uint32_t root);
int dmlc_reduce_host_comm(dmlc_device *dev, uint32_t comm, void *data, uint64_t count, int dtype,
                          int op, uint32_t root);
int dmlc_allgather_host_comm(dmlc_device *dev, uint32_t comm, const void *send, void *recv,
                             uint64_t sendcount, int dtype);
int dmlc_reduce_scatter_host_comm(dmlc_device *dev, uint32_t comm, const void *send, void *recv,
                                  uint64_t recvcount, int dtype, int op);
/* Returns once every member of `comm` has called it. */
int dmlc_barrier_comm(dmlc_device *dev, uint32_t comm);

/* ---- Errors ---- */

/* Static text naming a status (never NULL). */
const char *dmlc_strerror(int status);

/* Detail of the last error on this thread (never NULL; "" if none). Valid
 * until the next failing call on the same thread. */
const char *dmlc_last_error_message(void);

/* The status, device detail (e.g. the mismatch field mask) and peer of the
 * last failing call on this thread (status DMLC_OK and peer DMLC_NO_PEER if
 * none failed); generation is 0. For the calls that return only a status,
 * such as the host forms. out == NULL is a no-op. */
void dmlc_last_error_completion(dmlc_completion *out);

/* The length of the last failing call's DMLC_ERR_TRUNCATE on this thread, in
 * bytes: for dmlc_send the receive's room, for dmlc_recv the message's size
 * (as far as known); for DMLC_ERR_NONFINITE the element's index; 0 if that
 * call failed otherwise or none failed. */
uint64_t dmlc_last_error_length(void);

#ifdef __cplusplus
}
#endif

#endif /* DMLC_GUEST_H */
