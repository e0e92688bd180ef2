// The kernels' worker pool (shared by every build): N-1 pthreads made once by sc_set_threads, and the calling thread
// as the N-th. A job is a function over a range [0, n), cut into contiguous chunks that the threads claim one at a
// time from an atomic counter; the caller claims too, and returns when every chunk is done. Each chunk is computed
// by one thread with the same code whatever the thread count, so the kernels' results do not depend on it
// (tests/test_threads.py holds them bit-exact at 1 to 4 threads).
//
// Waiting. An OpenMP thread that spins while it waits (libgomp's default) made every torch op ~30x slower on these
// 2-core machines when the other core was busy (shared/FIELD-NOTES.md): the spinner holds the core that the thread
// it waits for needs. Here a waiting thread sleeps on a condition variable, after at most SPIN_NS of polling in
// which it calls sched_yield() between looks, so any other runnable thread on its core (a busy neighbour, the thread
// it waits for) gets the core at once. Why poll at all: a futex wake-up on this VM takes ~30 us (a condvar
// ping-pong: 57-62 us a round trip with the other core idle), longer than most gaps between a decode step's jobs;
// measured on the bundled model's step (151 jobs a token, medians of 60 tokens, other core idle): 1 thread 6.6-7.1
// ms, 2 threads sleeping at once 7.6-9.5 ms (the worker computed 22% of the chunks), 2 threads polling 20 us
// 5.6-6.4 ms (48%); 1B model: 31 ms, 25-27, 24-25. With the other core running a busy loop, that loop's rate was
// the same at 1 thread, 2 sleeping and 2 polling (3430-3640 M loops/s in 4-5 s windows, but one window of 12 at
// 2870, at 2 threads), and so was the step's time (6.6-7.6 ms against 7.1-7.2 at 1 thread).
// Claimed chunks rather than one per thread: a worker that comes late finds the chunks taken, and the caller waits
// only for chunks being computed.
// The backoff (colocated()): with the other core busy the scheduler wakes a worker on its caller's CPU, where it
// preempts the caller, and the two take turns on one core: 7.8 ms a token at 2 threads against 6.9 at 1 (bundled
// model, worker computing half the chunks). So a worker that wakes there leaves the job to the caller, and after
// BACKOFF_AFTER such wake-ups in a row jobs run on the caller alone for BACKOFF_NS: 6.5 against 7.1 ms at 1 thread
// (1B: 30.2 against 31.0), then the pool is tried again.
//
// One job at a time: a second caller (another Python thread) that finds the pool busy runs its job alone, on its
// own thread, rather than wait; so does a job started from inside a job. A fork()ed child has no workers (pthread
// _atfork): it runs alone until sc_set_threads is called again. sc_set_deal (tests) deals chunk k to thread k mod N
// instead, with no backoff: every thread then computes its share, however busy the machine.
#define _GNU_SOURCE  // sched_getcpu
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#include "kernels.h"

#define SC_MAX_THREADS 256
#define CHUNKS_PER_THREAD 4  // claims per thread: evens out a late or preempted worker
#define SPIN_NS 20000        // polling before a waiting thread sleeps (sched_yield between looks)
#define BACKOFF_AFTER 4      // wake-ups in a row on the caller's CPU ...
#define BACKOFF_NS 50000000  // ... make jobs run on the caller alone for 50 ms

typedef struct {
    sc_task fn;
    void* ctx;
    int n, chunk, nchunks, slots;
    int dealt;  // threads the chunks are dealt to (chunk k to thread k % dealt), or 0: claimed
    int cpu;    // the caller's CPU when it posted the job
} Job;

static struct {
    pthread_mutex_t submit;       // held by the running job's caller, and by a resize
    pthread_mutex_t mu;           // guards job, gen's writes, quit, waiting, born
    pthread_cond_t wake;          // workers: a new job (gen moved) or quit
    pthread_cond_t idle;          // the caller: the last chunk is done
    Job job;
    _Atomic unsigned gen;         // the current job's number (polled without mu)
    unsigned born;                // gen when the workers started: a job after it is theirs
    int quit, waiting, size;      // size: threads with the caller (1: no pool)
    _Atomic uint64_t claim;       // gen << 32 | the next unclaimed chunk
    _Atomic int left;             // chunks of the current job not yet done
    _Atomic size_t grain;         // jobs under this many bytes run on the caller alone
    _Atomic int deal;             // sc_set_deal
    _Atomic int streak;           // workers woken in a row on their caller's CPU
    _Atomic int64_t alone_until;  // CLOCK_MONOTONIC ns: till then jobs run on the caller alone (backoff)
    pthread_t tid[SC_MAX_THREADS];
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
       .size = 1, .grain = SC_GRAIN};

static int cpu_now(void) {  // this thread's CPU, or -1 where the system does not say
#ifdef __linux__
    return sched_getcpu();
#else
    return -1;
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

// Poll, yielding the core between looks, until gen moves past `seen` (a worker) or no chunk is left (the caller,
// seen_gen < 0); at most SPIN_NS. 1: it happened.
static int poll_briefly(long seen_gen) {
    int64_t end = now_ns() + SPIN_NS;
    for (;;) {
        if (seen_gen < 0 ? atomic_load(&P.left) <= 0 : atomic_load(&P.gen) != (unsigned)seen_gen) return 1;
        if (now_ns() > end) return 0;
        sched_yield();
    }
}

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
        if (atomic_fetch_sub(&P.left, 1) == 1) {
            pthread_mutex_lock(&P.mu);
            if (P.waiting) pthread_cond_signal(&P.idle);
            pthread_mutex_unlock(&P.mu);
        }
    }
}

// Whether this worker woke on its caller's CPU (then it leaves the job to the caller; BACKOFF_AFTER in a row start
// the backoff).
static int colocated(const Job* j) {
    if (j->cpu < 0 || cpu_now() != j->cpu) {
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
        if (P.gen == seen && !P.quit) {  // the next job of a decode step usually follows within microseconds
            pthread_mutex_unlock(&P.mu);
            poll_briefly(seen);
            pthread_mutex_lock(&P.mu);
        }
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

// Post job j (submit held), compute chunks with the workers, and return when all are done.
static void run_job(Job* j) {
    pthread_mutex_lock(&P.mu);
    unsigned gen = P.gen + 1;
    P.job = *j;
    atomic_store(&P.left, j->nchunks);
    atomic_store(&P.claim, (uint64_t)gen << 32);
    atomic_store(&P.gen, gen);
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.mu);
    run_chunks(j, gen, 0);
    if (atomic_load(&P.left) > 0 && !poll_briefly(-1)) {  // chunks still being computed by workers: wait
        pthread_mutex_lock(&P.mu);
        P.waiting = 1;
        while (atomic_load(&P.left) > 0) pthread_cond_wait(&P.idle, &P.mu);
        P.waiting = 0;
        pthread_mutex_unlock(&P.mu);
    }
}

void sc_parallel(sc_task fn, void* ctx, int n, int slots, size_t bytes) {
    if (n <= 0) return;
    if (n == 1 || slots <= 1 || bytes < atomic_load(&P.grain) || pthread_mutex_trylock(&P.submit)) {
        fn(ctx, 0, n, 0);  // alone: too small, or the pool is busy (another caller, a nested job, a resize)
        return;
    }
    int deal = atomic_load(&P.deal);
    if (P.size <= 1 || (!deal && now_ns() < atomic_load(&P.alone_until))) {  // no pool, or the backoff
        pthread_mutex_unlock(&P.submit);
        fn(ctx, 0, n, 0);
        return;
    }
    int t = P.size < slots ? P.size : slots, want = t * CHUNKS_PER_THREAD < n ? t * CHUNKS_PER_THREAD : n;
    Job j = {fn, ctx, n, (n + want - 1) / want, 0, t, deal ? t : 0, cpu_now()};
    j.nchunks = (n + j.chunk - 1) / j.chunk;
    run_job(&j);
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
// thread); a worker never waits on anything but mu and its condition variable, so this never hangs.
__attribute__((destructor)) static void pool_fini(void) {
    if (pthread_mutex_trylock(&P.submit)) return;
    stop_workers();
    pthread_mutex_unlock(&P.submit);
}
