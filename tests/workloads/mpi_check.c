/*
 * mpi_check: self-checking MPI workloads for the checkpoint tests
 * (tests/tests/mpi.rs, docs/MPI.md). Built with each MPI's mpicc.
 *
 *   mpi_check ring|allreduce|halo ITERATIONS PACE_US [BALLAST_MIB [PROGRESS_EVERY]]
 *
 * ring       a token of 64 KiB goes round the ranks ITERATIONS times; every
 *            rank checks the iteration, the hop count and every byte of it,
 *            and folds it into its state.
 * allreduce  every rank adds a contribution derived from its state each
 *            iteration; every rank simulates all ranks' states and checks
 *            the sum (and that every rank is at the same iteration).
 * halo       a periodic 1-D stencil over ranks x 4096 cells; each step the
 *            edge cells are exchanged with both neighbours, tagged with the
 *            step and checked; at the end rank 0 gathers the field and
 *            compares it with a serial computation of the same steps.
 *
 * BALLAST_MIB (cr-bench mpi): every rank also holds that much memory of
 * its own, filled from its rank at start and checked whole at the end.
 * PROGRESS_EVERY (default 50): iterations between two progress lines
 * (cr-bench mpi prints them often, to see the job's stalls).
 *
 * At the end every rank also checks that its host name is still the one it
 * started with (a job restarted on other nodes keeps its own).
 *
 * Any message out of order, lost, duplicated or corrupted fails at once
 * ("FAIL ..." and MPI_Abort). Rank 0 prints "progress N T" lines while it
 * runs (N iterations done at T, the wall clock in seconds, from which the
 * tests tell the job's pace before and after a move) and, at the end, after comparing every rank's state with a serial
 * recomputation, "RESULT OK MODE checksum=X" or "RESULT FAIL ...": the
 * result of a run with checkpoints must equal that of a run without.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TOKEN_WORDS (64 * 1024 / 8)
#define CELLS 4096

static int rank, size;
static long progress_every = 50;

static uint64_t mix(uint64_t a, uint64_t b)
{
    uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2));
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

static void fail(const char *what, long iter, uint64_t got, uint64_t want)
{
    printf("FAIL rank %d iteration %ld: %s (got %llu, want %llu)\n", rank, iter, what,
           (unsigned long long)got, (unsigned long long)want);
    fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 3);
}

static void progress(long i, long iters)
{
    if (rank == 0 && (i % progress_every == 0 || i == iters)) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        printf("progress %ld %.3f\n", i, (double)t.tv_sec + t.tv_nsec / 1e9);
        fflush(stdout);
    }
}

/* Word w of the token of iteration i after h hops. */
static uint64_t token_word(long i, int h, int w)
{
    return mix(mix((uint64_t)i, (uint64_t)h), (uint64_t)w);
}

/* The state of rank r after the token of iteration i reached it. */
static uint64_t ring_fold(uint64_t st, long i, int r)
{
    return mix(st, token_word(i, r, (int)(i % TOKEN_WORDS)));
}

static uint64_t run_ring(long iters, long pace)
{
    uint64_t *tok = malloc(sizeof(uint64_t) * (TOKEN_WORDS + 2));
    uint64_t st = (uint64_t)rank;
    int left = (rank + size - 1) % size, right = (rank + 1) % size;
    for (long i = 1; i <= iters; i++) {
        if (rank == 0) {
            tok[0] = (uint64_t)i;
            tok[1] = 0;
            for (int w = 0; w < TOKEN_WORDS; w++)
                tok[w + 2] = token_word(i, 0, w);
            MPI_Send(tok, TOKEN_WORDS + 2, MPI_UINT64_T, right, 7, MPI_COMM_WORLD);
        }
        MPI_Recv(tok, TOKEN_WORDS + 2, MPI_UINT64_T, left, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        int hops = rank == 0 ? size : rank;
        if (tok[0] != (uint64_t)i)
            fail("ring token of another iteration", i, tok[0], (uint64_t)i);
        if (tok[1] != (uint64_t)(hops - 1))
            fail("ring token with a wrong hop count", i, tok[1], (uint64_t)(hops - 1));
        for (int w = 0; w < TOKEN_WORDS; w++)
            if (tok[w + 2] != token_word(i, hops - 1, w))
                fail("ring token corrupted", i, tok[w + 2], token_word(i, hops - 1, w));
        st = ring_fold(st, i, rank);
        if (rank != 0) {
            tok[1] = (uint64_t)hops;
            for (int w = 0; w < TOKEN_WORDS; w++)
                tok[w + 2] = token_word(i, hops, w);
            MPI_Send(tok, TOKEN_WORDS + 2, MPI_UINT64_T, right, 7, MPI_COMM_WORLD);
        }
        progress(i, iters);
        if (pace)
            usleep(pace);
    }
    free(tok);
    return st;
}

static uint64_t ring_reference(int r, long iters)
{
    uint64_t st = (uint64_t)r;
    for (long i = 1; i <= iters; i++)
        st = ring_fold(st, i, r);
    return st;
}

static uint64_t contribution(uint64_t st, long i)
{
    return mix(st, (uint64_t)i) >> 8;
}

static uint64_t run_allreduce(long iters, long pace)
{
    uint64_t *all = malloc(sizeof(uint64_t) * size);
    for (int r = 0; r < size; r++)
        all[r] = (uint64_t)r + 1;
    for (long i = 1; i <= iters; i++) {
        uint64_t mine[2] = {contribution(all[rank], i), (uint64_t)i}, sum[2], lo;
        MPI_Allreduce(mine, sum, 2, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
        MPI_Allreduce(&mine[1], &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
        uint64_t want = 0;
        for (int r = 0; r < size; r++)
            want += contribution(all[r], i);
        if (sum[0] != want)
            fail("allreduce sum", i, sum[0], want);
        if (lo != (uint64_t)i || sum[1] != (uint64_t)i * size)
            fail("ranks at different iterations", i, lo, (uint64_t)i);
        for (int r = 0; r < size; r++)
            all[r] = mix(all[r], sum[0]);
        progress(i, iters);
        if (pace)
            usleep(pace);
    }
    uint64_t st = all[rank];
    free(all);
    return st;
}

static uint64_t cell_init(long g)
{
    return mix((uint64_t)g, 12345);
}

static uint64_t stencil(uint64_t l, uint64_t c, uint64_t r, long i)
{
    return (l * 3 + c * 5 + r * 7 + (uint64_t)i) % 2305843009213693951ULL;
}

static uint64_t *run_halo(long iters, long pace)
{
    uint64_t *u = malloc(sizeof(uint64_t) * (CELLS + 2)), *v = malloc(sizeof(uint64_t) * (CELLS + 2));
    int left = (rank + size - 1) % size, right = (rank + 1) % size;
    for (int j = 0; j < CELLS; j++)
        u[j + 1] = cell_init((long)rank * CELLS + j);
    for (long i = 1; i <= iters; i++) {
        uint64_t out_l[2] = {(uint64_t)i, u[1]}, out_r[2] = {(uint64_t)i, u[CELLS]};
        uint64_t in_l[2], in_r[2];
        int tag = (int)(i % 30000);
        MPI_Sendrecv(out_r, 2, MPI_UINT64_T, right, tag, in_l, 2, MPI_UINT64_T, left, tag,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Sendrecv(out_l, 2, MPI_UINT64_T, left, tag + 30000, in_r, 2, MPI_UINT64_T, right,
                     tag + 30000, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (in_l[0] != (uint64_t)i)
            fail("halo from the left of another step", i, in_l[0], (uint64_t)i);
        if (in_r[0] != (uint64_t)i)
            fail("halo from the right of another step", i, in_r[0], (uint64_t)i);
        u[0] = in_l[1];
        u[CELLS + 1] = in_r[1];
        for (int j = 1; j <= CELLS; j++)
            v[j] = stencil(u[j - 1], u[j], u[j + 1], i);
        uint64_t *t = u;
        u = v;
        v = t;
        progress(i, iters);
        if (pace)
            usleep(pace);
    }
    free(v);
    return u;
}

/* The whole field after `iters` steps, computed by one process. */
static int halo_reference_matches(const uint64_t *got, long iters)
{
    long n = (long)size * CELLS;
    uint64_t *u = malloc(sizeof(uint64_t) * n), *v = malloc(sizeof(uint64_t) * n);
    for (long g = 0; g < n; g++)
        u[g] = cell_init(g);
    for (long i = 1; i <= iters; i++) {
        for (long g = 0; g < n; g++)
            v[g] = stencil(u[(g + n - 1) % n], u[g], u[(g + 1) % n], i);
        uint64_t *t = u;
        u = v;
        v = t;
    }
    int ok = memcmp(u, got, sizeof(uint64_t) * n) == 0;
    free(u);
    free(v);
    return ok;
}

/*
 * Every pair of ranks talks once at start: MPI libraries open connections
 * lazily, and one opened for the first time after a restart on other nodes
 * would use the addresses of the old nodes (docs/MPI.md, Limits).
 */
static void connect_all(void)
{
    for (int d = 1; d < size; d++) {
        int to = (rank + d) % size, from = (rank - d + size) % size, out = rank, in = -1;
        MPI_Sendrecv(&out, 1, MPI_INT, to, 61000, &in, 1, MPI_INT, from, 61000, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        if (in != from)
            fail("warm-up message from another rank", 0, (uint64_t)in, (uint64_t)from);
    }
}

/* Memory of a rank's own: `words` words derived from its rank (and back). */
static uint64_t ballast_word(long i)
{
    return mix((uint64_t)rank + 1, (uint64_t)i);
}

static uint64_t *ballast_fill(long words)
{
    uint64_t *b = malloc(sizeof(uint64_t) * (words ? words : 1));
    if (!b) {
        printf("FAIL rank %d: cannot allocate its ballast\n", rank);
        fflush(stdout);
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    for (long i = 0; i < words; i++)
        b[i] = ballast_word(i);
    return b;
}

static int ballast_intact(const uint64_t *b, long words)
{
    for (long i = 0; i < words; i++) {
        if (b[i] != ballast_word(i)) {
            printf("FAIL rank %d: ballast word %ld changed\n", rank, i);
            fflush(stdout);
            return 0;
        }
    }
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 4 || argc > 6 || (argc == 6 && atol(argv[5]) < 1)) {
        fprintf(stderr, "usage: mpi_check ring|allreduce|halo ITERATIONS PACE_US "
                        "[BALLAST_MIB [PROGRESS_EVERY]]\n");
        return 2;
    }
    if (argc == 6)
        progress_every = atol(argv[5]);
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const char *mode = argv[1];
    long iters = atol(argv[2]), pace = atol(argv[3]);
    long ballast_words = argc >= 5 ? atol(argv[4]) * (1L << 20) / 8 : 0;
    uint64_t *ballast = ballast_fill(ballast_words);
    connect_all();
    char host[256] = "";
    gethostname(host, sizeof host);
    printf("rank %d of %d on %s pid %d\n", rank, size, host, (int)getpid());
    fflush(stdout);
    uint64_t sum = 0;
    int ok = 1;
    if (strcmp(mode, "ring") == 0 || strcmp(mode, "allreduce") == 0) {
        int ring = mode[0] == 'r';
        uint64_t st = ring ? run_ring(iters, pace) : run_allreduce(iters, pace);
        uint64_t *all = rank == 0 ? malloc(sizeof(uint64_t) * size) : NULL;
        MPI_Gather(&st, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            uint64_t *ref = malloc(sizeof(uint64_t) * size);
            if (ring) {
                for (int r = 0; r < size; r++)
                    ref[r] = ring_reference(r, iters);
            } else {
                /* The simulated states of every rank: the same on all. */
                for (int r = 0; r < size; r++)
                    ref[r] = (uint64_t)r + 1;
                for (long i = 1; i <= iters; i++) {
                    uint64_t s = 0;
                    for (int r = 0; r < size; r++)
                        s += contribution(ref[r], i);
                    for (int r = 0; r < size; r++)
                        ref[r] = mix(ref[r], s);
                }
            }
            for (int r = 0; r < size; r++) {
                if (all[r] != ref[r]) {
                    printf("RESULT FAIL %s: rank %d ends with state %llu, a serial run gives %llu\n",
                           mode, r, (unsigned long long)all[r], (unsigned long long)ref[r]);
                    ok = 0;
                }
                sum = mix(sum, all[r]);
            }
            free(ref);
        }
        free(all);
    } else if (strcmp(mode, "halo") == 0) {
        uint64_t *u = run_halo(iters, pace);
        uint64_t *all = rank == 0 ? malloc(sizeof(uint64_t) * size * CELLS) : NULL;
        MPI_Gather(u + 1, CELLS, MPI_UINT64_T, all, CELLS, MPI_UINT64_T, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            if (!halo_reference_matches(all, iters)) {
                printf("RESULT FAIL halo: the field differs from a serial run\n");
                ok = 0;
            }
            for (long g = 0; g < (long)size * CELLS; g++)
                sum = mix(sum, all[g]);
        }
        free(all);
        free(u);
    } else {
        if (rank == 0)
            fprintf(stderr, "mpi_check: unknown mode %s\n", mode);
        MPI_Finalize();
        return 2;
    }
    char now[256] = "";
    gethostname(now, sizeof now);
    int same = strcmp(now, host) == 0, all_same = 0;
    if (!same) {
        printf("FAIL rank %d: host name %s, started on %s\n", rank, now, host);
        fflush(stdout);
    }
    same = ballast_intact(ballast, ballast_words) && same;
    free(ballast);
    MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_same) {
        if (rank == 0)
            printf("RESULT FAIL the host name or the ballast of a rank changed\n");
        ok = 0;
    }
    if (rank == 0 && ok) {
        printf("RESULT OK %s ranks=%d iterations=%ld checksum=%016llx\n", mode, size, iters,
               (unsigned long long)sum);
    }
    fflush(stdout);
    MPI_Finalize();
    return ok ? 0 : 1;
}
