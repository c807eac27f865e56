/* In-process probe: process_vm_writev (to our own pid: the same kernel path as to a peer) against
 * memcpy of the same descriptors, 1 GiB-ish in permuted blocks. Used to find out why cma stays
 * below memcpy (docs/transport.md, "Why cma is below memcpy").
 *
 *   gcc -O2 -o /tmp/cma_probe benchmarks/cma_probe.c -lpthread
 *   /tmp/cma_probe MIB BLOCK_KIB THP(0|1) THREADS REPS
 * Environment: CPUT=1 times process CPU time instead of wall time; SORT=1 orders the rows by
 * destination; MERGE=1 merges destination-contiguous rows into one remote iovec (the two sides
 * of process_vm_writev cut independently); ONLYPVW=1 / ONLYMEM=1 run one side (for perf).
 * Prints both rates (best of REPS, alternating) and their ratio; THP=1 advises MADV_HUGEPAGE on
 * both buffers before first touch. Both buffers are faulted in before any timing. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

typedef struct { char *s, *d; size_t len; } desc;
typedef struct { size_t a, b; } range;
static desc *D;
static size_t ND;
static int MODE;
static pid_t PID;

static double now(void) {
    struct timespec t;
    clock_gettime(getenv("CPUT") ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *work(void *arg) {
    range *r = arg;
    if (MODE == 0) {
        for (size_t i = r->a; i < r->b; i++) memcpy(D[i].d, D[i].s, D[i].len);
        return 0;
    }
    struct iovec l[1024], m[1024];
    int merge = getenv("MERGE") != 0;
    for (size_t i = r->a; i < r->b;) {
        int k = 0, km = 0;
        for (; k < 1024 && i < r->b; k++, i++) {
            l[k].iov_base = D[i].s;
            l[k].iov_len = D[i].len;
            if (merge && km && (char *)m[km - 1].iov_base + m[km - 1].iov_len == D[i].d)
                m[km - 1].iov_len += D[i].len;
            else {
                m[km].iov_base = D[i].d;
                m[km].iov_len = D[i].len;
                km++;
            }
        }
        if (process_vm_writev(PID, l, k, m, km, 0) < 0) { perror("process_vm_writev"); exit(1); }
    }
    return 0;
}

static double run(int mode, int th) {
    MODE = mode;
    pthread_t t[8];
    range r[8];
    double t0 = now();
    for (int i = 0; i < th; i++) {
        r[i].a = ND * i / th;
        r[i].b = ND * (i + 1) / th;
        pthread_create(&t[i], 0, work, &r[i]);
    }
    for (int i = 0; i < th; i++) pthread_join(t[i], 0);
    return now() - t0;
}

int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage: %s MIB BLOCK_KIB THP THREADS REPS\n", argv[0]); return 2; }
    size_t n = (size_t)atoi(argv[1]) << 20, blk = (size_t)atoi(argv[2]) * 1024;
    int thp = atoi(argv[3]), th = atoi(argv[4]), reps = atoi(argv[5]);
    if (th < 1 || th > 8) th = 1;
    PID = getpid();
    char *s = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *d = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (thp) { madvise(s, n, MADV_HUGEPAGE); madvise(d, n, MADV_HUGEPAGE); }
    memset(s, 1, n);
    memset(d, 0, n);
    ND = n / blk;
    D = malloc(ND * sizeof(desc));
    size_t *p = malloc(ND * sizeof(size_t));
    for (size_t i = 0; i < ND; i++) p[i] = i;
    srand(1);
    for (size_t i = ND - 1; i > 0; i--) { size_t j = rand() % (i + 1), x = p[i]; p[i] = p[j]; p[j] = x; }
    for (size_t i = 0; i < ND; i++) {
        size_t k = getenv("SORT") ? p[i] : i;  /* SORT: row k writes destination block k */
        D[k].s = s + i * blk; D[k].d = d + p[i] * blk; D[k].len = blk;
    }
    double bm = 1e9, bc = 1e9;
    for (int r = 0; r < reps; r++) {
        double a = getenv("ONLYPVW") ? 1e9 : run(0, th), b = getenv("ONLYMEM") ? 1e9 : run(1, th);
        if (a < bm) bm = a;
        if (b < bc) bc = b;
    }
    printf("block=%zuK thp=%d threads=%d memcpy %.2f GB/s  process_vm_writev %.2f GB/s  ratio %.2f\n",
           blk / 1024, thp, th, n / bm / 1e9, n / bc / 1e9, bm / bc);
    return 0;
}
