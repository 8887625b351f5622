/* hicache: the worker threads the exact path's C kernels (rowdot.c, attend.c) share, kept
 * between calls (engine/runtime/model/native_pool.py builds it and hands hicache_pool_run to
 * the kernels).
 *
 * Starting threads per call cost 37 us a thread on a 2-core VM, and a product of a decode step
 * takes 150-600 us: the second thread came too late to read its share, so two threads read the
 * weights no faster than one. Here the workers stay: after a job a worker waits for the next
 * one for a short while, yielding the core between looks (torch's own threads, if they want
 * the core, get it), then sleeps on a condition variable until woken (at once when a job has
 * more threads than the machine has cores).
 *
 * Which thread computes an item never changes its bits (the kernels are invariant by
 * construction), so anything that stops the pool from being used — another thread inside it,
 * a worker that could not be started, a forked child (its workers do not exist there) — falls
 * back to threads started for the call.
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 63
#define WAIT_NS 2000000L          /* how long an idle worker looks for the next job */

typedef void *(*job_fn)(void *);

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;     /* held by the caller of a job */
static pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake[MAX_WORKERS + 1];             /* one per worker */
static int asleep[MAX_WORKERS + 1];                       /* under sleep_mu */
static int workers;                                       /* started, alive in this process */
/* the job's ticket: its number times 256 plus how many workers take part (1 .. that count):
 * one word, so a worker never pairs one job's number with another's count */
static uint64_t ticket;
static job_fn job;
static void *job_args[MAX_WORKERS + 1];
static uint64_t born[MAX_WORKERS + 1];     /* the job number when worker i was started */
static int job_done;
static int forked;                                        /* set in a forked child */
static int64_t wait_ns = WAIT_NS;     /* 0 while a job has more threads than cores: sleep */

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *worker(void *arg)
{
    const int id = (int)(intptr_t)arg;
    uint64_t seen = born[id];      /* the jobs after it are its own to look at */
    int64_t until = now_ns() + __atomic_load_n(&wait_ns, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t t = __atomic_load_n(&ticket, __ATOMIC_ACQUIRE);
        if (t >> 8 != seen) {
            seen = t >> 8;
            if (id <= (int)(t & 0xFF)) {
                job(job_args[id]);
                __atomic_add_fetch(&job_done, 1, __ATOMIC_ACQ_REL);
                /* only a worker that had work looks for more: one a job left out (a small
                 * call takes fewer threads) goes back to sleep */
                until = now_ns() + __atomic_load_n(&wait_ns, __ATOMIC_RELAXED);
            }
            continue;
        }
        if (now_ns() <= until) {
            sched_yield();
            continue;
        }
        pthread_mutex_lock(&sleep_mu);
        asleep[id] = 1;
        while (__atomic_load_n(&ticket, __ATOMIC_ACQUIRE) >> 8 == seen)
            pthread_cond_wait(&wake[id], &sleep_mu);
        asleep[id] = 0;
        pthread_mutex_unlock(&sleep_mu);
    }
    return 0;
}

static void after_fork_child(void)
{
    forked = 1;                    /* the workers are the parent's: never wait for them */
    pthread_mutex_init(&mu, 0);
    pthread_mutex_init(&sleep_mu, 0);
}

static pthread_once_t once = PTHREAD_ONCE_INIT;
static void at_load(void)
{
    for (int i = 0; i <= MAX_WORKERS; i++)
        pthread_cond_init(&wake[i], 0);
    pthread_atfork(0, 0, after_fork_child);
}

/* fn(args[0]) on the calling thread and fn(args[t]) on workers t = 1 .. threads - 1.
 * Returns 0 when the pool ran it, 1 when the caller must start its own threads (the pool is in
 * use by another thread, or workers cannot be started here): nothing has run then. */
int hicache_pool_run(job_fn fn, void **args, int32_t threads)
{
    pthread_once(&once, at_load);
    if (threads <= 1) {
        fn(args[0]);
        return 0;
    }
    if (threads > MAX_WORKERS + 1 || forked || pthread_mutex_trylock(&mu) != 0)
        return 1;
    while (workers < threads - 1) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        born[workers + 1] = __atomic_load_n(&ticket, __ATOMIC_ACQUIRE) >> 8;
        int rc = pthread_create(&tid, &attr, worker, (void *)(intptr_t)(workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            pthread_mutex_unlock(&mu);
            return 1;
        }
        workers++;
    }
    static long cores;
    if (!cores)
        cores = sysconf(_SC_NPROCESSORS_ONLN);
    /* more threads than cores: a worker that looks for work takes a core from one that has
     * it, so idle workers sleep at once */
    __atomic_store_n(&wait_ns, cores > 0 && threads > cores ? 0 : WAIT_NS, __ATOMIC_RELAXED);
    job = fn;
    for (int t = 1; t < threads; t++)
        job_args[t] = args[t];
    __atomic_store_n(&job_done, 0, __ATOMIC_RELEASE);
    pthread_mutex_lock(&sleep_mu);
    uint64_t next = ((__atomic_load_n(&ticket, __ATOMIC_ACQUIRE) >> 8) + 1) << 8;
    __atomic_store_n(&ticket, next | (uint64_t)(threads - 1), __ATOMIC_RELEASE);
    for (int t = 1; t < threads; t++)       /* wake only the sleepers this job needs */
        if (asleep[t])
            pthread_cond_signal(&wake[t]);
    pthread_mutex_unlock(&sleep_mu);
    fn(args[0]);
    while (__atomic_load_n(&job_done, __ATOMIC_ACQUIRE) < threads - 1)
        sched_yield();
    pthread_mutex_unlock(&mu);
    return 0;
}

/* the workers started so far (a report) */
int hicache_pool_workers(void) { return workers; }
