/*
 * dmlc_rabit.h - rabit-style C API of libdmlc_guest.
 *
 * For programs written against rabit's C API (rabit/c_api.h, as used by
 * xgboost): the same function names, and rabit's numbers for element types
 * and reduce operations, with the collectives going through the
 * virtio-dmlc device (or TCP, for comparison). Link with -ldmlc_guest
 * (libdmlc_guest.so or .a, built by `cargo build -p dmlc-capi`; the static
 * library also needs -lpthread -ldl -lm).
 *
 *     RabitInit(argc, argv);             // reads the DMLC environment
 *     int rank = RabitGetRank(), n = RabitGetWorldSize();
 *     float grad[4] = {...};
 *     RabitAllreduce(grad, 4, RABIT_FLOAT, RABIT_SUM, NULL, NULL);
 *     RabitBroadcast(model, model_bytes, 0);
 *     RabitTrackerPrint("epoch 1 done");
 *     RabitFinalize();
 *
 * Differences from rabit:
 *  - Every function that can fail returns an int status: RABIT_OK (0) or a
 *    negative RABIT_ERR_* code, and RabitGetLastError() gives a one-line
 *    message. (rabit's functions return void or bool and abort on errors.)
 *    Check RabitInit's result with `!= RABIT_OK`, not as a bool.
 *  - Extra element types (RABIT_HALF, RABIT_BFLOAT16), extra ops
 *    (RABIT_BITAND, RABIT_BITXOR, RABIT_PROD, RABIT_AVG) and RabitBarrier.
 *  - No checkpoints (RabitLoadCheckPoint and friends): a failed worker
 *    fails the job; the launcher stops the others.
 *  - Results are bitwise identical on every worker and every transport:
 *    the reduction is a fold in rank order 0..N-1. f16 and bf16 accumulate
 *    in f32. Integer sum and product wrap; RABIT_AVG is sum / N
 *    (integers truncate toward zero); float min/max give NaN if any input
 *    is NaN.
 *
 * The environment read by RabitInit (entries "DMLC_NAME=VALUE" in argv
 * override it; other arguments are ignored):
 *   DMLC_ROLE         worker (or unset); other roles are refused
 *   DMLC_TASK_ID      this worker's rank (checked against the device)
 *   DMLC_NUM_WORKER   number of workers (checked against the device)
 *   DMLC_TRANSPORT    device (default) or tcp
 *   DMLC_DEVICE       pci (the first virtio-dmlc PCI device, in a VM) or
 *                     pci:DOMAIN:BUS:SLOT.FN
 *   DMLC_SOCKET       path of a backend socket (host transport: this
 *                     process plays the VM)
 *   DMLC_DMA_BYTES    device-visible memory to set aside, e.g. 16M
 *   DMLC_POLL         hybrid (the default) spins up to 200 us and then sleeps,
 *                     poll (or 1) busy-polls, interrupt (or 0) sleeps at once
 *   DMLC_TCP_PEERS    tcp only: ip:port,... of every worker in rank order
 *   DMLC_TCP_CONNECT_TIMEOUT_S, DMLC_TCP_IO_TIMEOUT_S   tcp only
 * With neither DMLC_DEVICE nor DMLC_SOCKET and at most one worker, the
 * program runs alone: rank 0 of 1, and collectives return their input.
 *
 * One worker per process, shared by all threads; collectives of several
 * threads run one after another. Every worker must call the same
 * collectives in the same order with the same count, dtype, op and root.
 *
 * C99.
 */
#ifndef DMLC_RABIT_H
#define DMLC_RABIT_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* rabit's unsigned long type (sizes of RabitBroadcast). */
typedef unsigned long rbt_ulong;

/* ---- Status codes ---- */
typedef enum rabit_status {
    RABIT_OK = 0,
    RABIT_ERR_INVALID_ARGUMENT = -1,    /* NULL pointer, unknown dtype or op, bad size or root */
    RABIT_ERR_NOT_INITIALIZED = -2,     /* collective before RabitInit or after RabitFinalize */
    RABIT_ERR_ALREADY_INITIALIZED = -3, /* RabitInit twice without RabitFinalize */
    RABIT_ERR_ENVIRONMENT = -4,         /* DMLC_* settings wrong, missing, or not the device's */
    RABIT_ERR_CONNECT = -5,             /* device cannot be opened / tcp group not formed */
    RABIT_ERR_UNSUPPORTED = -6,         /* op not defined for the dtype (bitwise on floats) */
    RABIT_ERR_MISMATCH = -7,            /* workers called different collectives or sizes */
    RABIT_ERR_PEER_LOST = -8,           /* a worker left during the collective */
    RABIT_ERR_TIMEOUT = -9,             /* a worker did not arrive in time */
    RABIT_ERR_COLLECTIVE = -10,         /* any other failure of the device or transport */
    RABIT_ERR_INTERNAL = -11            /* internal library error */
} rabit_status;

/* ---- Element types (enum_dtype): rabit's numbers, then 10 and 11 ---- */
typedef enum rabit_dtype {
    RABIT_CHAR = 0,      /* signed char (int8_t) */
    RABIT_UCHAR = 1,     /* unsigned char (uint8_t) */
    RABIT_INT = 2,       /* int (int32_t) */
    RABIT_UINT = 3,      /* unsigned int (uint32_t) */
    RABIT_LONG = 4,      /* long (64-bit on LP64 targets) */
    RABIT_ULONG = 5,     /* unsigned long */
    RABIT_FLOAT = 6,     /* float */
    RABIT_DOUBLE = 7,    /* double */
    RABIT_LONGLONG = 8,  /* long long (int64_t) */
    RABIT_ULONGLONG = 9, /* unsigned long long (uint64_t) */
    RABIT_HALF = 10,     /* IEEE binary16, as uint16_t bits */
    RABIT_BFLOAT16 = 11  /* bfloat16, as uint16_t bits */
} rabit_dtype;

/* ---- Reduce operations (enum_op): rabit's numbers, then 4..7 ---- */
typedef enum rabit_op {
    RABIT_MAX = 0,
    RABIT_MIN = 1,
    RABIT_SUM = 2,
    RABIT_BITOR = 3,  /* bitwise ops: integer dtypes only */
    RABIT_BITAND = 4,
    RABIT_BITXOR = 5,
    RABIT_PROD = 6,
    RABIT_AVG = 7     /* sum / number of workers */
} rabit_op;

/* ---- Lifecycle ---- */

/* Joins the job described by the DMLC environment (see above). argv may be
 * NULL if argc is 0. Opens the device (or forms the TCP group). */
int RabitInit(int argc, char *argv[]);

/* Leaves the job: waits until every worker has called it (so no worker
 * exits while others still talk to it), then closes. The worker is gone
 * afterwards even if this fails; RabitInit may be called again. */
int RabitFinalize(void);

/* ---- Queries (never fail) ---- */

/* This worker's rank; 0 before RabitInit. */
int RabitGetRank(void);
/* Number of workers; 1 before RabitInit. */
int RabitGetWorldSize(void);
/* 1 if there is more than one worker, else 0. */
int RabitIsDistributed(void);

/* Writes the host name, NUL-terminated, into out_name (max_len bytes with
 * the NUL) and its full length into *out_len. A longer name is cut and
 * RABIT_ERR_INVALID_ARGUMENT returned. */
int RabitGetProcessorName(char *out_name, rbt_ulong *out_len, rbt_ulong max_len);

/* Prints msg on stderr as whole lines in one write (a newline is added if
 * missing). The launchers show each worker's lines with its rank. */
int RabitTrackerPrint(const char *msg);

/* ---- Collectives ---- */

/* In place: the count elements of enum_dtype at sendrecvbuf become the
 * element-wise reduction (enum_op) over every worker. If prepare_fun is not
 * NULL it is called with prepare_arg just before (to fill the buffer
 * lazily, as in rabit); it may call the query functions but no collective,
 * and must not throw. sendrecvbuf may be NULL if count is 0. */
int RabitAllreduce(void *sendrecvbuf, size_t count, int enum_dtype, int enum_op,
                   void (*prepare_fun)(void *arg), void *prepare_arg);

/* In place: the size bytes at sendrecv_data become the root's. Every worker
 * passes the same size. */
int RabitBroadcast(void *sendrecv_data, rbt_ulong size, int root);

/* Returns once every worker has called it (not in rabit's C API). */
int RabitBarrier(void);

/* ---- Errors ---- */

/* Message of the last failure on this thread ("" if none; never NULL).
 * Valid until the next failing call on the same thread. */
const char *RabitGetLastError(void);

#ifdef __cplusplus
}
#endif

#endif /* DMLC_RABIT_H */
