// The kernels' worker pool (shared by both builds): N-1 pthreads made once by sc_set_threads, asleep on a condition
// variable between jobs, and the calling thread as the N-th. A job is a function over a range [0, n), cut into
// contiguous chunks that the threads claim one at a time from an atomic counter; the caller claims too, and returns
// when every chunk is done. Each chunk is computed by one thread with the same code whatever the thread count, so
// the kernels' results do not depend on it (tests/test_threads.py holds them bit-exact at 1 to 4 threads).
//
// Why no spinning: on these 2-core machines the other core is often busy. An OpenMP thread that spins while it waits
// (libgomp's default) made every torch op ~30x slower there (shared/FIELD-NOTES.md), because the spinner holds a core
// the thread it waits for needs. Here a waiting thread always sleeps (futex, through the condition variable).
// Why claimed chunks rather than one fixed chunk per thread: a worker that wakes late (a futex wake-up costs some
// microseconds; a preempted one, a time slice) finds the chunks already taken and the caller never waits for it,
// only for chunks that are being computed.
// Why the backoff (colocated()): with the other core busy the scheduler wakes a worker on its caller's CPU, where it
// preempts the caller; the two then take turns on one core. Measured on the bundled model's decode step (151 jobs a
// token), the other core busy: 6.9 ms a token at 1 thread, 7.8 at 2 with the workers computing half the chunks, 8.4
// with them only stepping aside; with the backoff (after 4 such wake-ups in a row, 50 ms of jobs on the caller
// alone, then the pool is tried again) 6.5 against 7.1 at 1 thread (1B model: 30.2 against 31.0 ms), i.e. as one.
//
// One job at a time: a second caller (another Python thread) that finds the pool busy runs its job alone, on its
// own thread, rather than wait; so does a job started from inside a job. A fork()ed child has no workers (pthread
// _atfork): it runs alone until sc_set_threads is called again. sc_set_deal (tests) deals chunk k to thread k mod N
// instead, with no backoff: every thread then computes its share, however busy the machine.
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#include "kernels.h"

#define SC_MAX_THREADS 256
#define CHUNKS_PER_THREAD 4  // claims per thread: evens out a late or preempted worker
#define BACKOFF_AFTER 4      // wake-ups in a row on the caller's CPU ...
#define BACKOFF_NS 50000000  // ... make jobs run alone for 50 ms (then the pool is tried again)

typedef struct {
    sc_task fn;
    void* ctx;
    int n, chunk, nchunks, slots;
    int dealt;  // threads the chunks are dealt to (chunk k to thread k % dealt), or 0: claimed
    int cpu;    // the caller's CPU when it posted the job
} Job;

_Atomic long ST_jobs, ST_slept, ST_wchunks, ST_chunks, ST_serial;
SC_API long sc_dbg_stat(int i) { _Atomic long* a[] = {&ST_jobs, &ST_slept, &ST_wchunks, &ST_chunks, &ST_serial}; long v = *a[i]; *a[i] = 0; return v; }
static struct {
    pthread_mutex_t submit;  // held by the running job's caller, and by a resize
    pthread_mutex_t mu;      // guards job, gen, quit, waiting
    pthread_cond_t wake;     // workers: a new job (gen moved) or quit
    pthread_cond_t idle;     // the caller: the last chunk is done
    Job job;
    unsigned gen;                // the current job's number
    unsigned born;               // gen when the workers started: a job after it is theirs
    int quit, waiting, size;     // size: threads with the caller (1: no pool)
    _Atomic uint64_t claim;      // gen << 32 | the next unclaimed chunk
    _Atomic int left;            // chunks of the current job not yet done
    _Atomic size_t grain;        // jobs under this many bytes run on the caller alone
    _Atomic int deal;            // sc_set_deal: deal the chunks instead of letting threads claim them
    _Atomic int streak;          // workers woken in a row on their caller's CPU
    _Atomic int64_t alone_until; // CLOCK_MONOTONIC ns: till then jobs run on the caller alone (backoff)
    pthread_t tid[SC_MAX_THREADS];
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
       .size = 1, .grain = SC_GRAIN};

// The next chunk for thread `slot` of job `gen`: claimed from the counter, or dealt (`k`: the last one it ran); -1:
// none left (or a newer job replaced it).
static int next_chunk(const Job* j, unsigned gen, int slot, int k) {
    if (j->dealt) return k < 0 ? (slot < j->nchunks ? slot : -1) : k + j->dealt < j->nchunks ? k + j->dealt : -1;
    uint64_t c = atomic_load(&P.claim);
    do {
        if ((unsigned)(c >> 32) != gen || (int)(uint32_t)c >= j->nchunks) return -1;
    } while (!atomic_compare_exchange_weak(&P.claim, &c, c + 1));
    return (int)(uint32_t)c;
}

// Run chunks of job `gen` until none is left for this thread; the last chunk done wakes the caller.
static void run_chunks(const Job* j, unsigned gen, int slot) {
    for (int k = next_chunk(j, gen, slot, -1); k >= 0; k = next_chunk(j, gen, slot, k)) {
        int lo = k * j->chunk, hi = lo + j->chunk < j->n ? lo + j->chunk : j->n;
        j->fn(j->ctx, lo, hi, slot);
        ST_chunks++; if (slot) ST_wchunks++;
        if (atomic_fetch_sub(&P.left, 1) == 1) {
            pthread_mutex_lock(&P.mu);
            if (P.waiting) pthread_cond_signal(&P.idle);
            pthread_mutex_unlock(&P.mu);
        }
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

// Whether this worker woke on the CPU of the job's caller (the other cores busy: the scheduler put it there, and
// it preempted the caller): then it leaves the job to the caller, and after BACKOFF_AFTER such wake-ups in a row
// the pool stops waking workers for BACKOFF_NS (a wake-up that lands there costs two context switches, ~9 us).
static int colocated(const Job* j) {
    if (sched_getcpu() != j->cpu) {
        atomic_store(&P.streak, 0);
        return 0;
    }
    if (atomic_fetch_add(&P.streak, 1) + 1 >= BACKOFF_AFTER) {
        atomic_store(&P.streak, 0);
        atomic_store(&P.alone_until, now_ns() + BACKOFF_NS);
    }
    return 1;
}

static void* worker(void* arg) {
    int slot = (int)(intptr_t)arg;
    pthread_mutex_lock(&P.mu);
    unsigned seen = P.born;  // not P.gen: a job posted before this thread first ran is its job too
    for (;;) {
        while (!P.quit && P.gen == seen) pthread_cond_wait(&P.wake, &P.mu);
        if (P.quit) break;
        seen = P.gen;
        Job j = P.job;
        pthread_mutex_unlock(&P.mu);
        if (slot < j.slots && (j.dealt || !colocated(&j))) run_chunks(&j, seen, slot);
        pthread_mutex_lock(&P.mu);
    }
    pthread_mutex_unlock(&P.mu);
    return NULL;
}

void sc_parallel(sc_task fn, void* ctx, int n, int slots, size_t bytes) {
    if (n <= 0) return;
    if (n == 1 || slots <= 1 || bytes < atomic_load(&P.grain) || pthread_mutex_trylock(&P.submit)) {
        ST_serial++; fn(ctx, 0, n, 0);  // alone: too small, or the pool is busy (another caller, a nested job, a resize)
        return;
    }
    if (P.size <= 1 || (!atomic_load(&P.deal) && now_ns() < atomic_load(&P.alone_until))) {  // no pool; backoff
        pthread_mutex_unlock(&P.submit);
        fn(ctx, 0, n, 0);
        return;
    }
    int t = P.size < slots ? P.size : slots, want = t * CHUNKS_PER_THREAD < n ? t * CHUNKS_PER_THREAD : n;
    Job j = {fn, ctx, n, (n + want - 1) / want, 0, t, atomic_load(&P.deal) ? t : 0};
    j.nchunks = (n + j.chunk - 1) / j.chunk;
    j.cpu = sched_getcpu();
    pthread_mutex_lock(&P.mu);
    unsigned gen = ++P.gen;
    P.job = j;
    atomic_store(&P.left, j.nchunks);
    atomic_store(&P.claim, (uint64_t)gen << 32);
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.mu);
    run_chunks(&j, gen, 0);
    ST_jobs++;
    if (atomic_load(&P.left) > 0) { ST_slept++;  // chunks still being computed by workers: sleep until the last one is done
        pthread_mutex_lock(&P.mu);
        P.waiting = 1;
        while (atomic_load(&P.left) > 0) pthread_cond_wait(&P.idle, &P.mu);
        P.waiting = 0;
        pthread_mutex_unlock(&P.mu);
    }
    pthread_mutex_unlock(&P.submit);
}

// Stop and join every worker (submit held).
static void stop_workers(void) {
    pthread_mutex_lock(&P.mu);
    P.quit = 1;
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.mu);
    for (int i = 1; i < P.size; i++) pthread_join(P.tid[i], NULL);
    P.quit = 0;
    P.size = 1;
}

// Start workers 1..n-1 with every signal blocked (signals go to the caller's threads); fewer if creation fails.
static void start_workers(int n) {
    sigset_t all, old;
    pthread_mutex_lock(&P.mu);
    P.born = P.gen;
    pthread_mutex_unlock(&P.mu);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (P.size = 1; P.size < n; P.size++)
        if (pthread_create(&P.tid[P.size], NULL, worker, (void*)(intptr_t)P.size)) break;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static void fork_prepare(void) {
    pthread_mutex_lock(&P.submit);
    pthread_mutex_lock(&P.mu);
}

static void fork_parent(void) {
    pthread_mutex_unlock(&P.mu);
    pthread_mutex_unlock(&P.submit);
}

static void fork_child(void) {  // the workers were not copied: no pool here
    P.size = 1;
    fork_parent();
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

int sc_set_threads(int n) {
    n = n < 1 ? 1 : n > SC_MAX_THREADS ? SC_MAX_THREADS : n;
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&P.submit);  // no job runs while the pool changes
    if (n != P.size) {
        stop_workers();
        start_workers(n);
    }
    n = P.size;
    pthread_mutex_unlock(&P.submit);
    return n;
}

int sc_threads(void) { return P.size; }

int sc_set_deal(int on) {
    int prev = atomic_load(&P.deal);
    if (on >= 0) atomic_store(&P.deal, on != 0);
    return prev;
}

long sc_set_grain(long bytes) {
    long prev = (long)atomic_load(&P.grain);
    if (bytes >= 0) atomic_store(&P.grain, (size_t)bytes);
    return prev;
}

// At exit (or dlclose): wake and join the workers, unless a job is running (then exit ends them as it ends any
// thread); a sleeping worker holds no lock, so this never waits on one.
__attribute__((destructor)) static void pool_fini(void) {
    if (pthread_mutex_trylock(&P.submit)) return;
    stop_workers();
    pthread_mutex_unlock(&P.submit);
}
