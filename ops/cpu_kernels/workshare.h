/* Work sharing without waiting for threads to arrive: the fused decoder's loops.
 *
 * An OpenMP `omp for` ends in a barrier that waits until every thread of the team has
 * come to it. Served, the two compute threads share two cores with the event loop and
 * gRPC's threads; when one of those wakes (each token), a compute thread is descheduled,
 * and its partner waits at the next of the ~150 barriers of a step until the scheduler
 * gives it back its core. Here a loop's items are taken from a shared counter instead,
 * and a loop is over when all its items are *done*: a thread that has not come yet takes
 * no item and is waited for by nobody; a late thread finds the loops done and passes them.
 * Only a thread descheduled in the middle of an item is waited for (one small item).
 *
 *   phase k:   thread t takes items of its own block (a static schedule's share) from the
 *              block's counter, then items left in the others' blocks; then done[k] += its
 *              count, and it waits until done[k] == n (spin, then yield)
 *
 * Every thread runs the same sequence of loops, so each counts phases the same way
 * (ws_local.k). Which thread runs an item never changes its arithmetic: the same bits.
 */
#ifndef LLMWORKER_WORKSHARE_H
#define LLMWORKER_WORKSHARE_H

#include <immintrin.h>
#include <stdatomic.h>

#include "simd.h"

int sched_yield(void); /* <sched.h> hides it under -std=c11 */

#define WS_SPINS 2000 /* pauses before a waiting thread yields its core */

typedef struct {
    _Alignas(64) atomic_int done; /* items of the loop finished */
} ws_phase;

typedef struct {
    _Alignas(64) atomic_int next; /* the next item of one thread's block, from its start */
} ws_counter;

typedef struct {
    ws_phase *phases;     /* zeroed, one per loop of the call */
    ws_counter *counters; /* zeroed, [num_phases][nthreads] */
    int num_phases;
    int k;        /* this thread's next phase */
    int tid, nthreads;
    const void *warm[2]; /* bytes to ask into L2 at this loop's end (NULL: none) */
    size_t warm_n[2];
} ws_local;

static inline int ws_begin(ws_local *w) {
    if (w->k >= w->num_phases) __builtin_trap(); /* more loops than counted: a bug */
    return w->k++;
}

/* Block b of T of a loop of `total` items: [*lo, *hi), a static schedule's share. */
static inline void ws_block(int total, int b, int T, int *lo, int *hi) {
    *lo = (int)((int64_t)total * b / T);
    *hi = (int)((int64_t)total * (b + 1) / T);
}

/* The next item for this thread: from its own block of the loop first (thread t's block
 * is items [t n / T, (t + 1) n / T): each thread reads its own contiguous part of a weight
 * matrix, as a static schedule would, which the prefetchers follow), then from the other
 * blocks in turn (a late thread's items are taken by the others). `*step`: blocks this
 * thread has found empty. Returns `total` when there is none left. */
static inline int ws_next(const ws_local *w, int k, int total, int *step) {
    const int T = w->nthreads;
    while (*step < T) {
        const int b = (w->tid + *step) % T;
        int lo, hi;
        ws_block(total, b, T, &lo, &hi);
        const int i = lo + atomic_fetch_add_explicit(&w->counters[(size_t)k * T + b].next, 1,
                                                     memory_order_relaxed);
        if (i < hi) return i;
        ++*step;
    }
    return total;
}

/* Adds this thread's finished items, asks for what ws_local.warm names (decoder.c's
 * warm_next: the start of its part of the next loop's weights, which then streams in while
 * it waits here and through the work between the loops), then waits for all `total`
 * (acquire: their writes seen). */
static inline void ws_end(ws_local *w, int k, int mine, int total) {
    ws_phase *p = &w->phases[k];
    if (mine) atomic_fetch_add_explicit(&p->done, mine, memory_order_release);
    for (int j = 0; j < 2; j++) {
        if (w->warm[j]) prefetch_bytes_l2(w->warm[j], w->warm_n[j]);
        w->warm[j] = NULL;
    }
    for (int spins = 0; atomic_load_explicit(&p->done, memory_order_acquire) < total;)
        if (++spins < WS_SPINS) _mm_pause();
        else sched_yield();
}

/* for (each item i of this loop that this thread takes) { body }; then the loop's end.
 * `mine` counts the items this thread took so far (0 in the first body: lazy set-up). */
#define WS_FOR(w, i, mine, total)                                                              \
    for (int ws_k_ = ws_begin(w), ws_s_ = 0, mine = 0, i;                                      \
         ((i) = ws_next(w, ws_k_, (total), &ws_s_)) < (total)                                  \
         || (ws_end(w, ws_k_, mine, (total)), 0);                                              \
         (mine)++)

#endif
