/*
 * libcr_check WORKDIR MODE [PORT]: a program using libcr that checks, from
 * the inside, what its callbacks and critical sections saw. It prints
 * READY, lines the test waits for, and after WORKDIR/go "OK" (or "FAIL
 * reason") and exits.
 *
 * Modes:
 *   reconnect PORT  two thread-context callbacks (close_conn, order_cb) and a
 *                   signal-context one (sig_cb) of the main thread; close_conn
 *                   closes the connection to 127.0.0.1:PORT before the
 *                   checkpoint and reopens it after; every reopened
 *                   connection says "hello continue" or "hello restart" and
 *                   checks the server's answer.
 *   hang            a thread-context callback (hang_cb) that never calls
 *                   cr_checkpoint; the main thread keeps counting.
 *   refuse          refuse_cb returns -1 at the first checkpoint;
 *                   sig_refuse_cb cancels the second with code 77; the third
 *                   goes through.
 *   request SOCKET DIR
 *                   asks the agent on SOCKET for a checkpoint of itself into
 *                   DIR (cr_request_checkpoint) and waits for it
 *                   (cr_poll_checkpoint): > 0 in the original, -1 with
 *                   CR_ERESTARTED in a copy restarted from that image; its
 *                   callback (req_cb) sees 0, resp. > 0. In the original the
 *                   process holds the same number of fds before the request
 *                   and after the poll.
 *   forked          forks a child that does not exec (it holds the libcr
 *                   socket it inherited, which only the parent serves) and
 *                   counts; forked_cb prints "forked callback=RC" at each
 *                   checkpoint (0: continued, 1: restarted); after go the
 *                   child exits 0 and the parent checks it, and that its
 *                   callback saw the last checkpoint (a restart: > 0).
 *   sigqueue        the main thread blocks SIGUSR2 and queues it to the
 *                   process with a value (sigqueue): it stays pending
 *                   (libcr's thread must not take it) through the
 *                   checkpoint and restart; after go it is unblocked and
 *                   its handler runs once, in the main thread, with it.
 *   responder PORT  (without libcr) serves connections on PORT, one after
 *                   the other: answers "ping N" with "pong N" (N must go
 *                   1, 2, 3... across connections), "flush K" with
 *                   "flushed K", "reopen" with "reopen" (then takes the
 *                   next connection), "hello ADDR" with "hello ADDR" if
 *                   the connection comes from ADDR, "bye" with "bye",
 *                   then prints OK (or FAIL) and exits.
 *   flusher HOST PORT
 *                   connects to a responder and pings it from its main
 *                   thread; its thread-context callback (flush_cb) sends
 *                   "flush K" and needs the answer before it lets the
 *                   checkpoint go on (a transport's "quiet and flush"): it
 *                   only gets it if the peer still runs, i.e. if every
 *                   member's callbacks run before any member is frozen.
 *                   Prints "callback K continued|restarted" after each.
 *                   Its restart half runs only once the whole job is back:
 *                   it FAILs if WORKDIR/held exists (the test holds a node
 *                   of the job frozen while it does); it reads
 *                   cr_get_restart_info(), prints "moved from H1 (A1) to
 *                   H2 (A2)" (the node and addresses before and now) and
 *                   reopens its connection to the peer, which checks that
 *                   it comes from the new address (A2). If WORKDIR/moved
 *                   exists, the node and addresses must have changed.
 *                   When WORKDIR/ask appears, asks for a checkpoint of its
 *                   whole job (CR_SCOPE_JOB, through the agent at
 *                   $CR_AGENT_SOCKET) and says "job request continued"
 *                   once it is done. After WORKDIR/go says bye and checks
 *                   every answer.
 *   cs              the main thread holds two nested critical sections and
 *                   leaves them when WORKDIR/leave1 and WORKDIR/leave2
 *                   appear; a second thread tries cr_tryenter_cs while a
 *                   checkpoint waits ("pending N") and says when that
 *                   checkpoint is over ("idle N").
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "libcr.h"

static const char *workdir;
static int port;
static int conn = -1;
static char fail_reason[256];

/* What the callbacks saw. */
static volatile int continued, restarted, cancelled;
static volatile int last_thread_rc = -999, last_sig_rc = -999;
static volatile int sig_runs;
static volatile int rounds;
static char order[256];
static pthread_mutex_t order_lock = PTHREAD_MUTEX_INITIALIZER;

static void note(const char *s)
{
    pthread_mutex_lock(&order_lock);
    strncat(order, s, sizeof order - strlen(order) - 1);
    pthread_mutex_unlock(&order_lock);
}

static void fail(const char *why)
{
    if (!fail_reason[0])
        snprintf(fail_reason, sizeof fail_reason, "%s", why);
}

static int exists(const char *name)
{
    char p[4096];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", workdir, name);
    return stat(p, &st) == 0;
}

static void nap(void)
{
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
}

/* Blocks until WORKDIR/NAME exists: inotify on WORKDIR, watched before
 * the first look so that no creation is missed; a signal (a
 * signal-context callback) only makes it look again. */
static void wait_file(const char *name)
{
    char buf[4096];
    int fd = inotify_init1(IN_CLOEXEC);
    if (fd < 0 || inotify_add_watch(fd, workdir, IN_CREATE | IN_MOVED_TO) < 0) {
        printf("FAIL inotify on %s: %s\n", workdir, strerror(errno));
        exit(1);
    }
    while (!exists(name))
        if (read(fd, buf, sizeof buf) < 0 && errno != EINTR) {
            printf("FAIL read of inotify: %s\n", strerror(errno));
            exit(1);
        }
    close(fd);
}

/* Connect to the server and say hello; check its answer. */
static void open_conn(const char *hello)
{
    struct sockaddr_in a = {0};
    char buf[256], want[256];
    int n, got = 0;
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    conn = socket(AF_INET, SOCK_STREAM, 0);
    if (conn < 0 || connect(conn, (struct sockaddr *)&a, sizeof a) != 0) {
        fail("cannot connect to the server");
        return;
    }
    snprintf(buf, sizeof buf, "hello %s\n", hello);
    if (write(conn, buf, strlen(buf)) != (ssize_t)strlen(buf))
        fail("cannot write to the server");
    snprintf(want, sizeof want, "ack %s\n", hello);
    while (got < (int)strlen(want)) {
        n = read(conn, buf + got, sizeof buf - 1 - got);
        if (n <= 0) {
            fail("no answer from the server");
            return;
        }
        got += n;
    }
    buf[got] = 0;
    if (strcmp(buf, want) != 0)
        fail("wrong answer from the server");
}

/* Registered first: runs last before the checkpoint, first after. */
static int close_conn(void *arg)
{
    int rc;
    (void)arg;
    note("C<");
    close(conn);
    conn = -1;
    rc = cr_checkpoint(CR_CHECKPOINT_READY);
    note("C>");
    last_thread_rc = rc;
    if (rc > 0) {
        const struct cr_restart_info *ri = cr_get_restart_info();
        restarted++;
        if (!ri || !ri->src || !ri->src[0])
            fail("no restart info");
        else
            printf("restart info src=%s node_changed=%d addresses_changed=%d\n", ri->src,
                   ri->node_changed, ri->addresses_changed);
        open_conn("restart");
    } else if (rc == 0) {
        continued++;
        open_conn("continue");
    } else {
        cancelled++;
        open_conn("cancelled");
    }
    return 0;
}

/* Registered second: runs first before the checkpoint, last after. */
static int order_cb(void *arg)
{
    const struct cr_checkpoint_info *ci = cr_get_checkpoint_info();
    (void)arg;
    if (!ci || !ci->dest || !ci->dest[0])
        fail("no checkpoint info in a callback");
    note("O<");
    cr_checkpoint(CR_CHECKPOINT_READY);
    note("O>");
    rounds++; /* the last code of a checkpoint's callbacks */
    return 0;
}

/* Signal context: only async-signal-safe work. */
static int sig_cb(void *arg)
{
    (void)arg;
    sig_runs++;
    last_sig_rc = cr_checkpoint(CR_CHECKPOINT_READY);
    return 0;
}

static int hang_cb(void *arg)
{
    (void)arg;
    for (;;)
        pause();
    return 0;
}

static int refusals;
static int refuse_cb(void *arg)
{
    (void)arg;
    if (refusals++ == 0)
        return -1;
    last_thread_rc = cr_checkpoint(CR_CHECKPOINT_READY);
    return 0;
}

static volatile int sig_refusals;
static volatile int first_sig_rc;
static int sig_refuse_cb(void *arg)
{
    (void)arg;
    /* The first checkpoint never gets here (refuse_cb refused it). */
    if (sig_refusals++ == 0)
        first_sig_rc = last_sig_rc = cr_checkpoint(CR_CHECKPOINT_TEMP_FAILURE_CODE(77));
    else
        last_sig_rc = cr_checkpoint(CR_CHECKPOINT_READY);
    return 0;
}

static volatile int cs_left;
static volatile int cs_seen[8], cs_callbacks;
static int cs_cb(void *arg)
{
    (void)arg;
    if (cs_callbacks < 8)
        cs_seen[cs_callbacks] = cs_left;
    cs_callbacks++;
    last_thread_rc = cr_checkpoint(CR_CHECKPOINT_READY);
    return 0;
}

/* Each time a checkpoint is pending: cr_tryenter_cs must refuse. */
static void *try_thread(void *arg)
{
    int rounds = 0;
    (void)arg;
    for (;;) {
        while (cr_status() != CR_STATE_ACTIVE)
            nap();
        rounds++;
        if (cr_tryenter_cs(0) == 0) {
            fail("cr_tryenter_cs entered while a checkpoint was pending");
            cr_leave_cs(0);
        } else if (errno != EAGAIN) {
            fail("cr_tryenter_cs: errno is not EAGAIN");
        }
        printf("pending %d\n", rounds);
        while (cr_status() == CR_STATE_ACTIVE)
            nap();
        /* The test starts the next checkpoint only after this line: a
         * new one begun within one nap would otherwise go unseen. */
        printf("idle %d\n", rounds);
    }
    return NULL;
}

/* How many fds the process has open (BLCR's dup_spurious: a checkpoint
 * leaves none behind). */
static int fds_before = -1;
static int count_fds(void)
{
    int n = 0, fd;
    for (fd = 0; fd < 1024; fd++)
        if (fcntl(fd, F_GETFD) >= 0)
            n++;
    return n;
}

static volatile int queued_runs, queued_value, queued_tid, main_tid;
static void on_queued(int sig, siginfo_t *si, void *ctx)
{
    (void)sig;
    (void)ctx;
    queued_runs++;
    queued_value = si->si_value.sival_int;
    queued_tid = (int)syscall(SYS_gettid);
}

static volatile int forked_cb_rc = -999;
static int forked_cb(void *arg)
{
    (void)arg;
    forked_cb_rc = cr_checkpoint(CR_CHECKPOINT_READY);
    printf("forked callback=%d\n", forked_cb_rc);
    return 0;
}

static volatile int req_cb_rc = -999;
static int req_cb(void *arg)
{
    (void)arg;
    req_cb_rc = cr_checkpoint(CR_CHECKPOINT_READY);
    return 0;
}

static int said_continued, said_restarted;

/* flusher/responder: one line over the connection, one line back. */
static pthread_mutex_t conn_lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *conn_in;
static volatile int flushes, flush_restarts;

static int exchange(const char *say, const char *want)
{
    char line[256];
    int ok;
    pthread_mutex_lock(&conn_lock);
    ok = write(conn, say, strlen(say)) == (ssize_t)strlen(say) &&
         fgets(line, sizeof line, conn_in) && strcmp(line, want) == 0;
    pthread_mutex_unlock(&conn_lock);
    return ok;
}

/* The peer, for reopening the connection. */
static struct sockaddr_in peer;

/* Connect to the peer (conn_lock held). */
static int connect_peer(void)
{
    conn = socket(AF_INET, SOCK_STREAM, 0);
    return conn >= 0 && connect(conn, (struct sockaddr *)&peer, sizeof peer) == 0 &&
           (conn_in = fdopen(dup(conn), "r")) != NULL;
}

/* The restart half of flush_cb: the whole job must be back; look where
 * this process runs now and reopen the connection from there. */
static void rejoin(void)
{
    const struct cr_restart_info *ri = cr_get_restart_info();
    char say[300], line[300];
    if (exists("held"))
        fail("a restart callback ran while a member of the job was still frozen");
    if (!ri) {
        fail("cr_get_restart_info() returned NULL after a restart");
        return;
    }
    printf("moved from %s (%s) to %s (%s) node_changed=%d addresses_changed=%d\n",
           ri->hostname_before, ri->addresses_before, ri->hostname_now, ri->addresses_now,
           ri->node_changed, ri->addresses_changed);
    if (exists("moved") && (!ri->node_changed || !ri->addresses_changed ||
                            !strcmp(ri->hostname_before, ri->hostname_now)))
        fail("the restart info does not say that the node and addresses changed");
    if (!exchange("reopen\n", "reopen\n")) {
        fail("no answer to reopen from the peer in the restart callback");
        return;
    }
    pthread_mutex_lock(&conn_lock);
    fclose(conn_in);
    close(conn);
    /* The first address (IPv4 sorts first; the node's eth0). */
    snprintf(say, sizeof say, "hello %.*s\n", (int)strcspn(ri->addresses_now, " "),
             ri->addresses_now);
    if (!connect_peer() || write(conn, say, strlen(say)) != (ssize_t)strlen(say) ||
        !fgets(line, sizeof line, conn_in) || strcmp(line, say) != 0)
        fail("the reopened connection did not come from the new address");
    pthread_mutex_unlock(&conn_lock);
}

static int flush_cb(void *arg)
{
    char say[64], want[64];
    int k = flushes + 1, rc;
    (void)arg;
    snprintf(say, sizeof say, "flush %d\n", k);
    snprintf(want, sizeof want, "flushed %d\n", k);
    if (!exchange(say, want)) {
        fail("no answer to flush from the peer");
        return -1;
    }
    flushes = k;
    rc = cr_checkpoint(CR_CHECKPOINT_READY);
    if (rc > 0) {
        flush_restarts++;
        rejoin();
    }
    printf("callback %d %s\n", k, rc > 0 ? "restarted" : rc == 0 ? "continued" : "cancelled");
    return 0;
}

static int responder(int port_)
{
    struct sockaddr_in a = {0};
    char line[256], want[64];
    int one = 1, ls, c, pings = 0;
    FILE *in;
    a.sin_family = AF_INET;
    a.sin_port = htons(port_);
    ls = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1)) {
        printf("FAIL listen on %d: %s\n", port_, strerror(errno));
        return 1;
    }
    printf("READY\n");
next:
    c = accept(ls, NULL, NULL);
    in = c < 0 ? NULL : fdopen(c, "r");
    if (c < 0 || !in) {
        printf("FAIL accept: %s\n", strerror(errno));
        return 1;
    }
    while (fgets(line, sizeof line, in)) {
        const char *reply = line;
        char addr[256];
        int n;
        if (!strcmp(line, "reopen\n")) {
            if (write(c, line, strlen(line)) != (ssize_t)strlen(line))
                fail("cannot answer reopen");
            fclose(in);
            goto next;
        } else if (sscanf(line, "hello %255s", addr) == 1) {
            struct sockaddr_in from;
            socklen_t len = sizeof from;
            char got[INET_ADDRSTRLEN] = "?";
            if (getpeername(c, (struct sockaddr *)&from, &len) == 0)
                inet_ntop(AF_INET, &from.sin_addr, got, sizeof got);
            printf("reopened from %s (says %s)\n", got, addr);
            if (strcmp(got, addr) != 0) {
                snprintf(want, sizeof want, "wrong %s\n", got);
                reply = want;
            }
        } else if (sscanf(line, "ping %d", &n) == 1) {
            if (n != pings + 1) {
                snprintf(fail_reason, sizeof fail_reason, "ping %d after ping %d", n, pings);
                break;
            }
            pings = n;
            snprintf(want, sizeof want, "pong %d\n", n);
            reply = want;
        } else if (sscanf(line, "flush %d", &n) == 1) {
            snprintf(want, sizeof want, "flushed %d\n", n);
            reply = want;
        } else if (strcmp(line, "bye\n") != 0 && strncmp(line, "hello ", 6) != 0) {
            fail("unexpected line");
            break;
        }
        if (write(c, reply, strlen(reply)) != (ssize_t)strlen(reply)) {
            fail("cannot answer");
            break;
        }
        if (reply == line && !strcmp(line, "bye\n")) {
            printf("served %d pings\n", pings);
            if (fail_reason[0]) {
                printf("FAIL %s\n", fail_reason);
                return 1;
            }
            printf("OK\n");
            return 0;
        }
    }
    printf("FAIL %s\n", fail_reason[0] ? fail_reason : "the connection ended without bye");
    return 1;
}

int main(int argc, char **argv)
{
    const char *mode;
    long counter = 0;
    if (argc < 3) {
        fprintf(stderr, "usage: libcr_check WORKDIR MODE [PORT]\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    workdir = argv[1];
    mode = argv[2];
    if (!strcmp(mode, "responder"))
        return responder(atoi(argv[3]));
    if (cr_init() < 0) {
        printf("FAIL cr_init: %s\n", strerror(errno));
        return 1;
    }
    if (cr_checkpoint(0) != -CR_ENOTCB)
        fail("cr_checkpoint outside a callback did not return -CR_ENOTCB");
    if (cr_leave_cs(0) != -1 || errno != EINVAL)
        fail("cr_leave_cs outside a critical section did not fail with EINVAL");

    if (!strcmp(mode, "reconnect")) {
        port = atoi(argv[3]);
        open_conn("start");
        if (cr_register_callback(close_conn, NULL, CR_THREAD_CONTEXT) < 0 ||
            cr_register_callback(order_cb, NULL, CR_THREAD_CONTEXT) < 0 ||
            cr_register_callback(sig_cb, NULL, CR_SIGNAL_CONTEXT) < 0)
            fail("cr_register_callback");
        printf("READY\n");
        while (!exists("go")) {
            if (rounds == 1 && !said_continued) {
                said_continued = 1;
                printf("continued thread_rc=%d sig_rc=%d order=%s\n", last_thread_rc,
                       last_sig_rc, order);
            }
            if (rounds == 2 && restarted == 1 && !said_restarted) {
                said_restarted = 1;
                printf("restarted thread_rc=%d sig_rc=%d order=%s\n", last_thread_rc,
                       last_sig_rc, order);
            }
            nap();
        }
        /* The copy restored from the --kill checkpoint saw: the continue
         * of the first checkpoint, then the restart. */
        if (continued != 1 || restarted != 1 || cancelled != 0)
            fail("wrong number of continues/restarts");
        if (last_thread_rc <= 0 || last_sig_rc <= 0)
            fail("cr_checkpoint did not return > 0 after the restart");
        if (sig_runs != 2)
            fail("the signal-context callback did not run once per checkpoint");
        if (strcmp(order, "O<C<C>O>O<C<C>O>") != 0)
            fail("callbacks did not run in BLCR's order");
        open_conn("final");
    } else if (!strcmp(mode, "flusher")) {
        char say[64], want[64];
        int n = 0;
        struct timespec pace = {0, 20 * 1000 * 1000};
        peer.sin_family = AF_INET;
        peer.sin_port = htons(atoi(argv[4]));
        if (inet_pton(AF_INET, argv[3], &peer.sin_addr) != 1 || !connect_peer()) {
            printf("FAIL connect to %s:%s: %s\n", argv[3], argv[4], strerror(errno));
            return 1;
        }
        cr_register_callback(flush_cb, NULL, CR_THREAD_CONTEXT);
        printf("READY\n");
        while (!exists("go") && !fail_reason[0]) {
            if (!said_continued && exists("ask")) {
                cr_checkpoint_args_t args;
                cr_checkpoint_handle_t handle;
                int rc;
                said_continued = 1;
                cr_initialize_checkpoint_args_t(&args);
                args.cr_scope = CR_SCOPE_JOB;
                if (cr_request_checkpoint(&args, &handle) != 0) {
                    printf("FAIL cr_request_checkpoint of the job: %s\n", cr_strerror(errno));
                    return 1;
                }
                rc = cr_poll_checkpoint(&handle, NULL);
                if (rc <= 0) {
                    printf("FAIL cr_poll_checkpoint of the job returned %d: %s\n", rc,
                           cr_strerror(errno));
                    return 1;
                }
                printf("job request continued\n");
            }
            n++;
            snprintf(say, sizeof say, "ping %d\n", n);
            snprintf(want, sizeof want, "pong %d\n", n);
            if (!exchange(say, want))
                fail("wrong or no pong");
            nanosleep(&pace, NULL); /* a paced workload, not a wait */
        }
        if (!exchange("bye\n", "bye\n"))
            fail("no bye from the peer");
        printf("pinged %d times, %d flushes, %d restarts\n", n, flushes, flush_restarts);
    } else if (!strcmp(mode, "hang")) {
        cr_register_callback(hang_cb, NULL, CR_THREAD_CONTEXT);
        printf("READY\n");
        while (!exists("go")) {
            counter++;
            nap();
        }
        if (counter < 2)
            fail("the main thread did not run");
    } else if (!strcmp(mode, "refuse")) {
        cr_register_callback(refuse_cb, NULL, CR_THREAD_CONTEXT);
        cr_register_callback(sig_refuse_cb, NULL, CR_SIGNAL_CONTEXT);
        printf("READY\n");
        wait_file("go");
        /* 1st: refused by refuse_cb (its cr_checkpoint never ran);
         * 2nd: sig_refuse_cb cancelled with 77, so refuse_cb's
         * cr_checkpoint returned -CR_ETEMPFAIL; 3rd: through. */
        if (refusals != 3 || sig_refusals != 2)
            fail("the callbacks did not run once per checkpoint");
        if (first_sig_rc != -77)
            fail("cr_checkpoint(CR_CHECKPOINT_TEMP_FAILURE_CODE(77)) did not return -77");
        if (last_thread_rc != 0 || last_sig_rc != 0)
            fail("the third checkpoint did not continue");
    } else if (!strcmp(mode, "cs")) {
        pthread_t t;
        cr_register_callback(cs_cb, NULL, CR_THREAD_CONTEXT);
        cr_enter_cs(0);
        cr_enter_cs(0); /* nested */
        pthread_create(&t, NULL, try_thread, NULL);
        printf("READY\n");
        wait_file("leave1");
        cr_leave_cs(0);
        cs_left = 1;
        printf("left1 status=%d callbacks=%d\n", cr_status(), cs_callbacks);
        wait_file("leave2");
        cs_left = 2;
        cr_leave_cs(0);
        printf("left2\n");
        wait_file("enter3");
        cr_enter_cs(0);
        cs_left = 3;
        printf("entered again\n");
        wait_file("go");
        cr_leave_cs(0);
        /* The checkpoint that waited ran its callback once both sections
         * were left; the --cs-proceed one inside the third. */
        if (cs_callbacks != 2 || cs_seen[0] != 2 || cs_seen[1] != 3)
            fail("callbacks did not run when the critical sections allowed");
        if (last_thread_rc != 0)
            fail("the checkpoints did not continue");
    } else if (!strcmp(mode, "sigqueue")) {
        struct sigaction sa;
        sigset_t set, pending;
        union sigval v;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_queued;
        sa.sa_flags = SA_SIGINFO;
        sigaction(SIGUSR2, &sa, NULL);
        sigemptyset(&set);
        sigaddset(&set, SIGUSR2);
        pthread_sigmask(SIG_BLOCK, &set, NULL);
        main_tid = (int)syscall(SYS_gettid);
        v.sival_int = 4242;
        if (sigqueue(getpid(), SIGUSR2, v) != 0)
            fail("sigqueue");
        printf("READY\n");
        wait_file("go");
        if (queued_runs != 0)
            fail("the handler ran while the main thread blocked the signal");
        sigpending(&pending);
        if (!sigismember(&pending, SIGUSR2))
            fail("the queued signal is not pending");
        pthread_sigmask(SIG_UNBLOCK, &set, NULL);
        if (queued_runs != 1 || queued_value != 4242 || queued_tid != main_tid)
            fail("the handler did not run once in the main thread with the value");
    } else if (!strcmp(mode, "forked")) {
        int status = -1;
        pid_t kid;
        cr_register_callback(forked_cb, NULL, CR_THREAD_CONTEXT);
        kid = fork();
        if (kid == 0) {
            while (!exists("go")) {
                counter++;
                nap();
            }
            _exit(counter > 1 ? 0 : 3);
        }
        if (kid < 0)
            fail("fork");
        printf("READY\n");
        wait_file("go");
        if (kid > 0 && (waitpid(kid, &status, 0) != kid || !WIFEXITED(status) ||
                        WEXITSTATUS(status) != 0))
            fail("the child did not run on and exit 0");
        if (forked_cb_rc <= 0)
            fail("the callback did not see the restart");
    } else if (!strcmp(mode, "request")) {
        cr_checkpoint_args_t args;
        cr_checkpoint_handle_t handle;
        struct timeval none = {0, 0};
        int rc, err;
        setenv("CR_AGENT_SOCKET", argv[3], 1);
        setenv("CR_CHECKPOINT_DIR", argv[4], 1);
        cr_register_callback(req_cb, NULL, CR_THREAD_CONTEXT);
        printf("READY\n");
        wait_file("ask");
        fds_before = count_fds();
        if (cr_initialize_checkpoint_args_t(&args) != 0)
            fail("cr_initialize_checkpoint_args_t");
        args.cr_scope = CR_SCOPE_TREE;
        if (cr_request_checkpoint(&args, &handle) != 0) {
            printf("FAIL cr_request_checkpoint: %s\n", cr_strerror(errno));
            return 1;
        }
        rc = cr_poll_checkpoint(&handle, NULL);
        err = errno;
        if (rc > 0) {
            int fds_after = count_fds();
            printf("request continued callback=%d\n", req_cb_rc);
            if (req_cb_rc != 0)
                fail("the callback did not see the checkpoint continue");
            if (fds_after != fds_before)
                fail("cr_poll_checkpoint returned with another set of open fds");
        } else if (rc < 0 && err == CR_ERESTARTED) {
            printf("request restarted callback=%d\n", req_cb_rc);
            if (req_cb_rc <= 0)
                fail("the callback did not see the restart");
        } else {
            printf("FAIL cr_poll_checkpoint returned %d: %s\n", rc, cr_strerror(err));
            return 1;
        }
        /* Reported once: the handle is gone. */
        if (cr_poll_checkpoint(&handle, &none) != -1 || errno != EINVAL)
            fail("a handle was reported twice");
        wait_file("go");
    } else {
        fail("unknown mode");
    }
    if (fail_reason[0]) {
        printf("FAIL %s\n", fail_reason);
        return 1;
    }
    printf("OK\n");
    return 0;
}
