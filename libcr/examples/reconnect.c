/*
 * reconnect HOST PORT COUNT: a program that keeps a connection to a server
 * outside its job (a license server, a database) and closes it around
 * checkpoints: a checkpoint callback closes it before the checkpoint and
 * opens it again afterwards, whether the process continues or was
 * restarted (maybe on another node, with another address).
 *
 * It sends COUNT numbered lines, one every 50 ms, each answered by the
 * server with one line, and exits 0 once all were answered.
 *
 * Build: cc -Iinclude libcr/examples/reconnect.c -Ltarget/release -lcr -o reconnect
 */
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "libcr.h"

static const char *host, *port;
static int fd = -1;
static int connections;

static int connect_server(void)
{
    struct addrinfo hints = {0}, *res, *a;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, port, &hints, &res) != 0)
        return -1;
    for (a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) == 0)
            break;
        if (fd >= 0)
            close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd >= 0)
        connections++;
    return fd >= 0 ? 0 : -1;
}

/* Runs in libcr's thread before every checkpoint. */
static int around_checkpoint(void *arg)
{
    int rc;
    (void)arg;
    close(fd); /* nothing of the outside connection goes into the image */
    fd = -1;
    rc = cr_checkpoint(CR_CHECKPOINT_READY);
    if (rc > 0) {
        const struct cr_restart_info *ri = cr_get_restart_info();
        printf("restarted from %s%s\n", ri ? ri->src : "?",
               ri && ri->node_changed ? " on another node" : "");
    } else if (rc < 0) {
        printf("checkpoint cancelled: %s\n", cr_strerror(rc));
    }
    if (connect_server() != 0) {
        printf("cannot reconnect to %s:%s\n", host, port);
        return -1;
    }
    printf("reconnected (%s)\n", rc > 0 ? "restart" : rc == 0 ? "continue" : "cancelled");
    return 0;
}

int main(int argc, char **argv)
{
    int i, count;
    char line[64], answer[64];
    if (argc != 4) {
        fprintf(stderr, "usage: reconnect HOST PORT COUNT\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    host = argv[1];
    port = argv[2];
    count = atoi(argv[3]);
    if (cr_init() < 0 || cr_register_callback(around_checkpoint, NULL, CR_THREAD_CONTEXT) < 0) {
        perror("libcr");
        return 1;
    }
    if (connect_server() != 0) {
        printf("cannot connect to %s:%s\n", host, port);
        return 1;
    }
    printf("connected\n");
    for (i = 1; i <= count; i++) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        int n, len;
        /* No checkpoint between a question and its answer. */
        cr_enter_cs(0);
        len = snprintf(line, sizeof line, "%d\n", i);
        n = write(fd, line, len) == len ? (int)read(fd, answer, sizeof answer - 1) : -1;
        cr_leave_cs(0);
        if (n <= 0) {
            printf("line %d: no answer\n", i);
            return 1;
        }
        nanosleep(&ts, NULL);
    }
    printf("sent %d lines over %d connections\n", count, connections);
    return 0;
}
