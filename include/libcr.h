/*
 * libcr.h - programs taking part in their checkpoints (libcr.so).
 *
 * Source compatible with BLCR's libcr: programs written for BLCR build
 * with `cc -Iinclude prog.c -Ltarget/release -lcr` and work unchanged
 * under this project's checkpointers (cr_checkpoint, the node agent, a
 * coordinated job checkpoint) and cr_restart. See docs/API.md.
 *
 * How it works: cr_init() makes the process reachable by the checkpointer
 * (a Unix socket $CR_COOP_DIR/libcr-<pidns>-<pid>.sock, default directory
 * /run/cr/coop, served by a thread of the library). Before freezing the process the
 * checkpointer asks it to run its callbacks; each callback prepares (e.g.
 * closes a connection to a server outside the job), then calls
 * cr_checkpoint(), which returns once the checkpoint is taken (0) or, in a
 * process restarted from the image, after the restart (> 0); the callback
 * then reopens what it closed. Callbacks run last registered first before
 * the checkpoint, and their code after cr_checkpoint() runs first
 * registered first.
 *
 * A callback that does not call cr_checkpoint() within the checkpointer's
 * --callback-timeout (default 30 s) fails the checkpoint, naming it; the
 * process runs on. A callback returning non-zero without calling
 * cr_checkpoint() refuses the checkpoint (it fails, naming the callback;
 * the process runs on).
 *
 * Differences from BLCR: CR_CHECKPOINT_PERM_FAILURE cancels the
 * checkpoint like CR_CHECKPOINT_TEMP_FAILURE but kills nothing (a
 * checkpoint never hurts the application); CR_CHECKPOINT_OMIT also
 * cancels it (a tree is saved whole). Error codes have this library's own
 * values (use the names).
 */
#ifndef LIBCR_H
#define LIBCR_H 1

#include <sys/types.h>
#include <sys/time.h>
#include <errno.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of cr_checkpoint_args_t understood by this library. */
typedef int cr_version_t;
#define CR_CHECKPOINT_ARGS_VERSION 1

/* A callback: returns 0 on success. It receives the `arg` given at its
 * registration. */
typedef int (*cr_callback_t)(void *);

/* Returned by cr_init(); accepted (and ignored) by cr_{enter,leave}_cs. */
typedef int cr_client_id_t;

/* Returned by cr_register_callback(). */
typedef int cr_callback_id_t;

/* Where a callback runs (flags of cr_register_callback):
 * CR_THREAD_CONTEXT: in the library's own thread, one callback after the
 *   other; any function may be called there.
 * CR_SIGNAL_CONTEXT: in a signal handler (signal SIGRTMAX-2) of the thread
 *   that registered it, while that thread is interrupted; only
 *   async-signal-safe functions there. Signal-context callbacks run after
 *   the thread-context ones have reached their cr_checkpoint(). */
#define CR_THREAD_CONTEXT 0x4000000
#define CR_SIGNAL_CONTEXT 0x2000000

/* Client id usable by callbacks. */
#define CR_ID_CALLBACK ((cr_client_id_t)(-1))

/* Flags of cr_checkpoint(). */
enum {
    CR_CHECKPOINT_READY = 0,        /* take the checkpoint */
    CR_CHECKPOINT_TEMP_FAILURE = 1, /* cancel it; the process runs on */
    CR_CHECKPOINT_PERM_FAILURE = 2, /* cancel it (nothing is killed) */
    CR_CHECKPOINT_OMIT = 4          /* cancel it (a tree is saved whole) */
};
/* Cancel with error code v (cr_checkpoint() then returns -v). */
#define CR_CHECKPOINT_TEMP_FAILURE_CODE(v) (CR_CHECKPOINT_TEMP_FAILURE | ((v) << 16))
#define CR_CHECKPOINT_PERM_FAILURE_CODE(v) (CR_CHECKPOINT_PERM_FAILURE | ((v) << 16))

/* Error codes beyond errno's (returned negated by cr_checkpoint, or set
 * in errno). */
#define CR_ENOINIT    200 /* cr_init() was not called */
#define CR_ENOTCB     201 /* not called from a checkpoint callback */
#define CR_ETEMPFAIL  202 /* the checkpoint was cancelled; the process runs on */
#define CR_EPERMFAIL  203 /* a callback refused the checkpoint permanently */
#define CR_ERESTARTED 204 /* the process was restarted from the checkpoint */
#define CR_ENOSUPPORT 205 /* not supported */

/* cr_status() values. */
enum { CR_STATE_IDLE = 0, CR_STATE_PENDING = 1, CR_STATE_ACTIVE = 2 };

/* Scopes of a checkpoint request (cr_checkpoint_args_t.cr_scope). */
typedef enum {
    CR_SCOPE_PROC = 0, /* the process */
    CR_SCOPE_PGRP = 1, /* its process group */
    CR_SCOPE_SESS = 2, /* its session */
    CR_SCOPE_TREE = 3, /* the process and its descendants */
    CR_SCOPE_JOB = 4   /* ours: the whole cluster job the process is a member of */
} cr_scope_t;

/* A checkpoint request (cr_request_checkpoint). */
typedef unsigned long cr_checkpoint_handle_t;

/* What cr_get_checkpoint_info() returns during a checkpoint. */
struct cr_checkpoint_info {
    int signal;         /* always 0: no signal is sent after a checkpoint */
    const char *dest;   /* the image directory */
    pid_t requester;    /* 0: not known */
    pid_t target;       /* this process */
    cr_scope_t scope;   /* CR_SCOPE_PROC */
};

/* What cr_get_restart_info() returns after a restart. The first two
 * fields are BLCR's; the others tell whether the process now runs on
 * another node or with other addresses (compared with when it was
 * frozen). In a coordinated restart of a job, restart callbacks run only
 * once every member of the job, on every node, runs again. */
struct cr_restart_info {
    pid_t requester;              /* 0: not known */
    const char *src;              /* the image directory restored from */
    const char *hostname_before;  /* the node's host name at the checkpoint (the checkpointer's) */
    const char *hostname_now;     /* the node's host name now (the restorer's) */
    int node_changed;             /* 1 if the host names differ */
    int addresses_changed;        /* 1 if the IP addresses differ */
    const char *addresses_before; /* the node's IP addresses (not loopback), space separated */
    const char *addresses_now;
};

/* Arguments of a checkpoint request (BLCR's layout). */
typedef struct cr_checkpoint_args {
    cr_version_t cr_version;
    cr_scope_t cr_scope;
    pid_t cr_target;
    int cr_fd;
    int cr_signal;
    unsigned int cr_timeout;
    unsigned int cr_flags;
} cr_checkpoint_args_t;

/* cr_init: make the process reachable by checkpointers (creates the
 * socket and the library's thread, installs the SIGRTMAX-2 handler).
 * May be called from every thread (BLCR required it once per thread that
 * uses libcr; here once is enough, later calls are cheap). Returns a
 * client id >= 0, or -1 with errno set. Not from a signal handler. */
extern cr_client_id_t cr_init(void);

/* cr_register_callback: register `func` (called with `arg`) to run before
 * every checkpoint, in the context given by `flags` (CR_THREAD_CONTEXT or
 * CR_SIGNAL_CONTEXT). Calls cr_init() if needed. The error messages of a
 * failed checkpoint name the callback by its symbol (link the program with
 * -rdynamic to have its own functions' names). Returns the callback's id
 * (>= 0), or -1 with errno (EINVAL: no function or bad flags; ENOSPC: too
 * many callbacks). */
extern cr_callback_id_t cr_register_callback(cr_callback_t func, void *arg, int flags);

/* cr_replace_callback: put `func`/`arg`/`flags` in the place of callback
 * `id` (same position in the order). 0, or -1 with errno (EINVAL). */
extern int cr_replace_callback(cr_callback_id_t id, cr_callback_t func, void *arg, int flags);

/* cr_checkpoint: called by a callback once it is ready. Runs the
 * callbacks registered before it, then waits for the checkpoint.
 * Returns 0: the checkpoint is taken, the process runs on; > 0: the
 * process was restarted from the checkpoint (see cr_get_restart_info);
 * < 0: the checkpoint was cancelled (-CR_ETEMPFAIL, or the code given to
 * CR_CHECKPOINT_*_FAILURE_CODE) and the process runs on; -CR_ENOTCB
 * outside a callback. With a failure flag (CR_CHECKPOINT_TEMP_FAILURE,
 * ..._PERM_FAILURE, ..._OMIT) it cancels the checkpoint: the checkpointer
 * fails naming this callback, and it returns at once. */
extern int cr_checkpoint(int flags);

/* cr_status: CR_STATE_ACTIVE while a checkpoint of this process is in
 * progress (from the request to its outcome), else CR_STATE_IDLE. */
extern int cr_status(void);

/* cr_enter_cs: enter a critical section; a checkpoint waits until every
 * critical section is left (up to the checkpointer's --cs-wait, default
 * 10 s; then it fails, or proceeds with --cs-proceed). Blocks while a
 * checkpoint is in progress, unless this thread is already inside a
 * critical section: sections nest, each enter needs its leave. 0. */
extern int cr_enter_cs(cr_client_id_t id);

/* cr_tryenter_cs: like cr_enter_cs but never blocks: 0 when entered, -1
 * with errno EAGAIN while a checkpoint is in progress. */
extern int cr_tryenter_cs(cr_client_id_t id);

/* cr_leave_cs: leave this thread's innermost critical section. 0, or -1
 * with errno EINVAL if the thread is in none. */
extern int cr_leave_cs(cr_client_id_t id);

/* cr_get_checkpoint_info: the checkpoint in progress (or last taken), or
 * NULL with errno CR_ENOTCB if there was none. The struct stays valid. */
extern const struct cr_checkpoint_info *cr_get_checkpoint_info(void);

/* cr_get_restart_info: the last restart of this process, or NULL with
 * errno CR_ENOTCB if it was never restarted. The struct stays valid. */
extern const struct cr_restart_info *cr_get_restart_info(void);

/* cr_strerror: the text of an error code (libcr's or errno's, either
 * sign). The string stays valid. */
extern const char *cr_strerror(int code);

/* cri_init_checkpoint_args_t: fill `args` with defaults (scope
 * CR_SCOPE_PROC, target 0 = this process, no fd, no signal, no timeout).
 * Use the macro cr_initialize_checkpoint_args_t. 0, or -1 (EINVAL). */
extern int cri_init_checkpoint_args_t(cr_version_t version, cr_checkpoint_args_t *args);
#define cr_initialize_checkpoint_args_t(args) \
    cri_init_checkpoint_args_t(CR_CHECKPOINT_ARGS_VERSION, (args))

/* cr_request_checkpoint: ask the node's agent (cr-agent; socket
 * $CR_AGENT_SOCKET or the default) for a checkpoint of this process. Call
 * cr_initialize_checkpoint_args_t(args) first. args->cr_target: 0 or
 * getpid() (only oneself); args->cr_scope: CR_SCOPE_PROC or
 * CR_SCOPE_TREE (this process's tree; for a process of a cr_run job,
 * the job's tree), or CR_SCOPE_JOB (the whole cluster job, on every node,
 * through the coordinator). The image goes to $CR_CHECKPOINT_DIR, else
 * the job's cr_run --dir, else ckpt.PID in the working directory (a
 * job's images: where the coordinator puts them). cr_fd, cr_signal,
 * cr_timeout and cr_flags are ignored. Returns 0 once the agent accepted,
 * with *handle set for cr_poll_checkpoint; the checkpoint then runs (this
 * program's callbacks too, in the library's thread). Without an agent,
 * a checkpoint of one's own tree is taken by the standalone cr_checkpoint
 * ($CR_CHECKPOINT_PROGRAM, else the one next to libcr.so, else on PATH),
 * which detaches from the program and reports to it as the agent would.
 * -1 with errno: EINVAL (bad arguments, another target), CR_ENOSUPPORT
 * (CR_SCOPE_JOB without an agent, cr_checkpoint not found, or
 * CR_SCOPE_PGRP/CR_SCOPE_SESS), EPERM (the agent refused), EIO (no
 * cr_init). Do not call it inside a critical section: the checkpoint
 * would wait for it. */
extern int cr_request_checkpoint(cr_checkpoint_args_t *args, cr_checkpoint_handle_t *handle);

/* cr_poll_checkpoint: wait for a requested checkpoint to end, up to
 * *timeout (NULL: no limit; {0, 0}: do not wait). Returns > 0 when it was
 * taken (the process runs on); 0 when it has not ended within the
 * timeout; -1 with errno CR_ERESTARTED in a process restarted from it,
 * CR_ETEMPFAIL when it failed (the process runs on), EINVAL for an
 * unknown handle (or one already reported). */
extern int cr_poll_checkpoint(cr_checkpoint_handle_t *handle, struct timeval *timeout);

#ifdef __cplusplus
}
#endif

#endif /* LIBCR_H */
