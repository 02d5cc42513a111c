/* mlx-tracer's BLAS shim: MLX's plain CBLAS names, served by scipy-openblas.
 *
 * cblas_dgemm and cblas_cgemm forward to OpenBLAS's scipy_-prefixed ones.
 * cblas_sgemm (every fp32 matmul of MLX's CPU backend) splits the work itself:
 * OpenBLAS runs single-threaded, and a GEMM worth splitting is cut into a
 * fixed number of chunks of output rows or columns that the calling thread
 * and a small pool of workers pull from one atomic counter. A thread the
 * scheduler preempts delays only the chunk it holds; OpenBLAS's own threading
 * splits statically and spins until every thread is done, which collapses
 * beside busy processes.
 *
 * Determinism: the chunks depend on the shape (transposes, sizes) only, never
 * on the thread count or on timing, and a call with one thread (or one that
 * finds the pool busy) runs the same chunks one after another on the caller.
 * Each chunk is one single-threaded OpenBLAS call, so the bits of C are a
 * function of the call's arguments: the same for 1, 2 or 8 threads and from
 * run to run (tests/test_blas.py checks). They are not the bits of one unsplit
 * call: a chunk may take another OpenBLAS kernel than the whole call would.
 *
 * Where to cut: few-row GEMMs (decode: at most FEW_ROWS rows of x in x @ W.T)
 * along the weight rows, into chunks small enough for OpenBLAS's small-matrix
 * kernel, which on the SkylakeX build does 1 x 576 rows at ~39 ns a row where
 * its blocked kernel takes ~180 (1 x 1536: ~95 vs ~520); anything larger
 * along its longer side (prefill).
 *
 * Idle workers sleep on a futex after a short bounded spin (SPIN_NS). The
 * caller, once no chunk is left to take, waits for the chunks in flight the
 * same way.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

extern void scipy_cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
extern void scipy_cblas_dgemm(int, int, int, int, int, int, double, const double *, int, const double *, int, double, double *, int);
extern void scipy_cblas_cgemm(int, int, int, int, int, int, const void *, const void *, int, const void *, int, const void *, void *, int);
extern void scipy_openblas_set_num_threads(int);

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112, CONJ_TRANS = 113 };

/* The kernel rules below are OpenBLAS's on x86-64; elsewhere (arm64 forwards
 * 1-row GEMMs to GEMV, with other small-matrix permits) the shim forwards
 * every call and OpenBLAS threads itself. */
#if defined(__x86_64__)
#define SPLIT 1
#else
#define SPLIT 0
#endif

#define MAX_WORKERS 63
#define MAX_CHUNKS 128
#define MAX_LARGE_CHUNKS 16        /* chunks of a GEMM that is not few-row */
#define FEW_ROWS 32                /* a GEMM with at most this many rows on one side is "few-row" */
#define ALIGN 32                   /* chunk boundaries: multiples of this many rows or columns */
#define MIN_SPLIT_WORK (1L << 18)  /* M*N*K below this runs on the caller, unsplit */
#define MIN_CHUNK_WORK (1L << 16)  /* M*N*K of one chunk, at least (where the shape allows) */
#define FEW_CHUNK_WORK (1L << 17)  /* M*N*K of one few-row chunk, about (calls cost ~2 us each) */
#define SPIN_NS 20000L             /* how long an idle thread spins before it sleeps */

/* One GEMM in column-major (Fortran) form, as OpenBLAS's interface sees it:
 * C[m x n] = alpha * op(A)[m x k] op(B)[k x n] + beta * C, ld* >= the stored row count. */
typedef struct {
    int ta, tb, m, n, k, lda, ldb, ldc;
    float alpha, beta;
    const float *a, *b;
    float *c;
    int by_rows;             /* chunks are row ranges of C (else column ranges) */
    int serial;              /* the chunks run on the caller, one after another (small work) */
    int bounds[MAX_CHUNKS + 1];
} gemm_t;

/* The job word: generation << 32 | chunk count << 16 | next chunk to take. */
#define JOB_GEN(v) ((uint32_t)((v) >> 32))
#define JOB_COUNT(v) ((int)(((v) >> 16) & 0xffff))
#define JOB_NEXT(v) ((int)((v) & 0xffff))

typedef struct {
    _Alignas(64) atomic_uint wake;  /* futex word: the generation this worker was last asked to join */
    atomic_int sleeping;
} worker_t;

static struct {
    pthread_mutex_t lock;        /* one split GEMM at a time; a concurrent caller runs its chunks itself */
    atomic_int threads;          /* threads per split GEMM, the caller included */
    int started;                 /* worker threads running */
    uint32_t gen;
    gemm_t job;
    _Alignas(64) _Atomic uint64_t word;
    _Alignas(64) atomic_uint done;   /* futex word: chunks of the current job finished */
    atomic_int caller_sleeping;
    atomic_long splits, worker_chunks;  /* counts, for tests and tools */
    worker_t workers[MAX_WORKERS];
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .threads = 1};

static long futex(atomic_uint *addr, int op, unsigned val)
{
    return syscall(SYS_futex, (unsigned *)addr, op | FUTEX_PRIVATE_FLAG, val, NULL, NULL, 0);
}

static long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Wait until *addr != seen: spin up to SPIN_NS, then sleep on the futex. */
static unsigned wait_change(atomic_uint *addr, unsigned seen, atomic_int *sleeping)
{
    unsigned v;
    long until = now_ns() + SPIN_NS;
    for (int i = 1;; i++) {
        if ((v = atomic_load(addr)) != seen)
            return v;
        cpu_relax();
        if ((i & 63) == 0 && now_ns() > until)
            break;
    }
    atomic_store(sleeping, 1);
    while ((v = atomic_load(addr)) == seen)
        futex(addr, FUTEX_WAIT, seen);
    atomic_store(sleeping, 0);
    return v;
}

/* One chunk is one OpenBLAS call on the sub-matrices of its rows or columns of C. */
static void run_chunk(const gemm_t *g, int i)
{
    int lo = g->bounds[i], hi = g->bounds[i + 1];
    const float *a = g->a, *b = g->b;
    float *c = g->c;
    int m = g->m, n = g->n;
    if (g->by_rows) {
        a += g->ta ? (long)lo * g->lda : lo;
        c += lo;
        m = hi - lo;
    } else {
        b += g->tb ? lo : (long)lo * g->ldb;
        c += (long)lo * g->ldc;
        n = hi - lo;
    }
    scipy_cblas_sgemm(COL_MAJOR, g->ta ? TRANS : NO_TRANS, g->tb ? TRANS : NO_TRANS, m, n, g->k, g->alpha, a, g->lda,
                      b, g->ldb, g->beta, c, g->ldc);
}

/* Take and run chunks of generation gen until none is left; returns how many ran. */
static int take_chunks(uint32_t gen)
{
    int ran = 0;
    uint64_t v = atomic_load(&pool.word);
    for (;;) {
        if (JOB_GEN(v) != gen || JOB_NEXT(v) >= JOB_COUNT(v))
            return ran;
        if (!atomic_compare_exchange_weak(&pool.word, &v, v + 1))
            continue;
        /* This chunk is ours: the job cannot finish (nor its fields change) before it is done. */
        int count = JOB_COUNT(v);
        run_chunk(&pool.job, JOB_NEXT(v));
        ran++;
        if (atomic_fetch_add(&pool.done, 1) + 1 == (unsigned)count && atomic_load(&pool.caller_sleeping))
            futex(&pool.done, FUTEX_WAKE, 1);
        v = atomic_load(&pool.word);
    }
}

static void *worker_main(void *arg)
{
    worker_t *w = arg;
    unsigned seen = 0;
    for (;;) {
        seen = wait_change(&w->wake, seen, &w->sleeping);
        int ran = take_chunks(seen);
        if (ran)
            atomic_fetch_add(&pool.worker_chunks, ran);
    }
    return NULL;
}

/* Start workers up to n (under pool.lock); returns how many run. */
static int start_workers(int n)
{
    if (n > MAX_WORKERS)
        n = MAX_WORKERS;
    while (pool.started < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 20);
        int err = pthread_create(&t, &attr, worker_main, &pool.workers[pool.started]);
        pthread_attr_destroy(&attr);
        if (err)
            break;
        pool.started++;
    }
    return pool.started;
}

/* The fork child has the pool's memory but none of its threads. */
static void after_fork_child(void)
{
    pthread_mutex_init(&pool.lock, NULL);
    pool.started = 0;
    for (int i = 0; i < MAX_WORKERS; i++) {
        atomic_store(&pool.workers[i].wake, 0);
        atomic_store(&pool.workers[i].sleeping, 0);
    }
    pool.gen = 0;
    atomic_store(&pool.word, 0);
}

__attribute__((constructor)) static void shim_init(void)
{
    if (SPLIT)
        scipy_openblas_set_num_threads(1);
    pthread_atfork(NULL, NULL, after_fork_child);
}

/* Which kernel OpenBLAS's interface picks (interface/gemm.c, x86-64): its
 * small-matrix kernel where the permit of the SkylakeX kernels allows (other
 * x86-64 cores permit none: the few-row chunks then run the blocked kernel,
 * still deterministic), else its blocked one. */
static int small_kernel(int ta, int tb, long m, long n, long k)
{
    if ((double)m * n * k > 1e6)
        return 0;
    if (ta)
        return tb ? k >= 4 : (m * n <= 1200 && k >= 32);
    return 1;
}

static void set_bounds(gemm_t *g, long len, long count)
{
    long units = (len + ALIGN - 1) / ALIGN;
    for (long i = 0; i <= count; i++) {
        long b = (units * i / count) * ALIGN;
        g->bounds[i] = (int)(b < len ? b : len);
    }
}

/* A GEMM too small to share among threads that OpenBLAS would still run on
 * its blocked kernel (packing costs it more than the arithmetic), cut along
 * its longer side into the fewest pieces that each take the small-matrix
 * kernel, run on the caller. Attention's scores in a decode step are one:
 * R query heads x D against S keys (R x S above the kernel's permit of 1200
 * outputs once S > 1200 / R), measured 1.5-4x slower whole than as R
 * one-row calls. Returns the piece count (1: leave it whole). */
static int small_pieces(gemm_t *g)
{
    if (small_kernel(g->ta, g->tb, g->m, g->n, g->k) || !small_kernel(g->ta, g->tb, 1, 1, g->k))
        return 1;
    g->by_rows = g->m >= g->n;
    long len = g->by_rows ? g->m : g->n, units = (len + ALIGN - 1) / ALIGN;
    for (long count = 2; count <= MAX_CHUNKS && count <= units; count++) {
        set_bounds(g, len, count);
        int small = 1;
        for (long i = 0; i < count && small; i++) {
            long part = g->bounds[i + 1] - g->bounds[i];
            small = g->by_rows ? small_kernel(g->ta, g->tb, part, g->n, g->k) : small_kernel(g->ta, g->tb, g->m, part, g->k);
        }
        if (small) {
            g->serial = 1;
            return (int)count;
        }
    }
    return 1;
}

/* Cut g into chunks: a function of the shape only. Sets g->by_rows and
 * g->bounds; returns the chunk count (1: do not split). */
static int plan_chunks(gemm_t *g)
{
    long work = (long)g->m * g->n * g->k;
    g->by_rows = g->m >= g->n;
    g->serial = 0;
    if (work < MIN_SPLIT_WORK)
        return small_pieces(g);
    if (g->n <= FEW_ROWS && g->m >= 2 * ALIGN) {
        /* Few-row: along m (the weight rows of x @ W.T), the fewest chunks of
         * about FEW_CHUNK_WORK that each take the small-matrix kernel. */
        long units = (g->m + ALIGN - 1) / ALIGN;
        long count = (work + FEW_CHUNK_WORK - 1) / FEW_CHUNK_WORK;
        if (count < 2)
            count = 2;
        if (count > MAX_CHUNKS)
            count = MAX_CHUNKS;
        if (count > units)
            count = units;
        for (; count <= MAX_CHUNKS && count <= units; count++) {
            g->by_rows = 1;
            set_bounds(g, g->m, count);
            int small = 1;
            for (long i = 0; i < count && small; i++)
                small = small_kernel(g->ta, g->tb, g->bounds[i + 1] - g->bounds[i], g->n, g->k);
            if (small)
                return (int)count;
        }
    }
    g->by_rows = g->m >= g->n;
    long len = g->by_rows ? g->m : g->n;
    long units = (len + ALIGN - 1) / ALIGN;
    long count = work / MIN_CHUNK_WORK;
    if (count > MAX_LARGE_CHUNKS)
        count = MAX_LARGE_CHUNKS;
    if (count > units)
        count = units;
    if (count < 2)
        return 1;
    set_bounds(g, len, count);
    return (int)count;
}

/* A CBLAS call in column-major form (OpenBLAS's own reduction); returns 0
 * for arguments not to split (OpenBLAS then sees them as they came, and
 * reports those that are wrong). */
static int to_col_major(gemm_t *g, int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                        int lda, const float *b, int ldb, float beta, float *c, int ldc)
{
    if ((ta != NO_TRANS && ta != TRANS && ta != CONJ_TRANS) || (tb != NO_TRANS && tb != TRANS && tb != CONJ_TRANS))
        return 0;
    if (order == COL_MAJOR) {
        *g = (gemm_t){.ta = ta != NO_TRANS, .tb = tb != NO_TRANS, .m = m, .n = n, .k = k, .lda = lda, .ldb = ldb,
                      .ldc = ldc, .alpha = alpha, .beta = beta, .a = a, .b = b, .c = c};
    } else if (order == ROW_MAJOR) { /* C^T = op(B)^T op(A)^T */
        *g = (gemm_t){.ta = tb != NO_TRANS, .tb = ta != NO_TRANS, .m = n, .n = m, .k = k, .lda = ldb, .ldb = lda,
                      .ldc = ldc, .alpha = alpha, .beta = beta, .a = b, .b = a, .c = c};
    } else {
        return 0;
    }
    if (g->m <= 0 || g->n <= 0 || g->k <= 0)
        return 0;
    if (g->lda < (g->ta ? g->k : g->m) || g->ldb < (g->tb ? g->n : g->k) || g->ldc < g->m)
        return 0;
    return 1;
}

void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float al, const float *a, int lda, const float *b,
                 int ldb, float be, float *c, int ldc)
{
    int threads = atomic_load(&pool.threads);
    gemm_t g;
    int count = 1;
    if (SPLIT && to_col_major(&g, o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc))
        count = plan_chunks(&g);
    if (count < 2) {
        scipy_cblas_sgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
        return;
    }
    int helpers = 0;
    if (!g.serial && threads >= 2 && pthread_mutex_trylock(&pool.lock) == 0) {
        helpers = start_workers(threads - 1);
        if (helpers < 1)
            pthread_mutex_unlock(&pool.lock);
    }
    if (helpers < 1) { /* one thread, or the pool busy: the same chunks, one after another */
        for (int i = 0; i < count; i++)
            run_chunk(&g, i);
        return;
    }
    if (helpers > count - 1)
        helpers = count - 1;
    uint32_t gen = ++pool.gen;
    if (gen == 0) /* 0 is every worker's initial "seen" */
        gen = ++pool.gen;
    pool.job = g;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.word, (uint64_t)gen << 32 | (uint64_t)count << 16);
    for (int i = 0; i < helpers; i++) {
        worker_t *w = &pool.workers[i];
        atomic_store(&w->wake, gen);
        if (atomic_load(&w->sleeping))
            futex(&w->wake, FUTEX_WAKE, 1);
    }
    atomic_fetch_add(&pool.splits, 1);
    take_chunks(gen);
    unsigned d;
    long until = now_ns() + SPIN_NS;
    for (int i = 1; (d = atomic_load(&pool.done)) != (unsigned)count; i++) {
        cpu_relax();
        if ((i & 63) == 0 && now_ns() > until)
            break;
    }
    if (d != (unsigned)count) {
        atomic_store(&pool.caller_sleeping, 1);
        while ((d = atomic_load(&pool.done)) != (unsigned)count)
            futex(&pool.done, FUTEX_WAIT, d);
        atomic_store(&pool.caller_sleeping, 0);
    }
    pthread_mutex_unlock(&pool.lock);
}

/* Threads per split GEMM from now on, the caller included (1: never split);
 * where the shim does not split, OpenBLAS's own thread count. */
void mlx_tracer_blas_set_threads(int n)
{
    n = n < 1 ? 1 : n;
    if (SPLIT)
        atomic_store(&pool.threads, n);
    else
        scipy_openblas_set_num_threads(n);
}

/* Whether cblas_sgemm splits (else OpenBLAS threads). */
int mlx_tracer_blas_splits(void) { return SPLIT; }

int mlx_tracer_blas_threads(void) { return SPLIT ? atomic_load(&pool.threads) : 1; }

/* Split GEMMs so far, and the chunks of them that worker threads ran. */
void mlx_tracer_blas_counts(long *splits, long *worker_chunks)
{
    *splits = atomic_load(&pool.splits);
    *worker_chunks = atomic_load(&pool.worker_chunks);
}

/* For tests: the chunks cblas_sgemm cuts a column-major call into (transposes
 * 0/1); returns the count (1: unsplit), *by_rows and count + 1 bounds. */
int mlx_tracer_blas_plan(int ta, int tb, int m, int n, int k, int *by_rows, int *bounds)
{
    gemm_t g = {.ta = ta, .tb = tb, .m = m, .n = n, .k = k};
    int count = plan_chunks(&g);
    *by_rows = g.by_rows;
    for (int i = 0; i <= count; i++)
        bounds[i] = count > 1 ? g.bounds[i] : (i ? (g.by_rows ? m : n) : 0);
    return count;
}

void cblas_dgemm(int o, int ta, int tb, int m, int n, int k, double al, const double *a, int lda, const double *b,
                 int ldb, double be, double *c, int ldc)
{
    scipy_cblas_dgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}

void cblas_cgemm(int o, int ta, int tb, int m, int n, int k, const void *al, const void *a, int lda, const void *b,
                 int ldb, const void *be, void *c, int ldc)
{
    scipy_cblas_cgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}
