// Team: one OpenMP region held for a call, its parallel_for calls posted to the waiting threads
// (team.h says why). Compiled once (integer bookkeeping and atomics: no vector ISA).
#include "cpu/team.h"

#include <c10/util/ParallelGuard.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace jacobi::cpu {
namespace {

inline void spin_pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether JACOBI_EXT_CPU_TEAM=0 turns the team off (each kernel its own region, as before: to
// compare the two on one machine, and for the tests). Read at each call (once a forward).
bool team_turned_off() {
  const char* env = std::getenv("JACOBI_EXT_CPU_TEAM");
  return env != nullptr && std::strcmp(env, "0") == 0;
}

}  // namespace

Team*& Team::leading() {
  thread_local Team* team = nullptr;
  return team;
}

void Team::fail() {
  if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
}

void Team::run(int64_t begin, int64_t end, int64_t grain, Call call, const void* fn) {
  if (begin >= end) return;
  const int64_t range = end - begin;
  // at::parallel_for's inline case; and a parallel_for inside a chunk of this thread's (nested:
  // the workers are busy with this job), inline as ATen runs one inside a parallel region
  if (range <= grain || range <= 1 || threads_ <= 1 || in_job_) {
    c10::ParallelGuard guard(true);
    call(fn, begin, end);
    return;
  }
  const int64_t n = grain > 0 ? std::min<int64_t>(threads_, divup(range, grain)) : threads_;
  call_ = call;
  fn_ = fn;
  begin_ = begin;
  end_ = end;
  chunk_ = divup(range, n);  // thread i: [begin + i chunk, ...) where that starts before end
  acks_.store(0, std::memory_order_relaxed);  // (every worker acknowledged the last job)
  posted_.fetch_add(1, std::memory_order_release);
  in_job_ = true;
  {
    c10::ParallelGuard guard(true);
    try {
      call(fn, begin, std::min(end, begin + chunk_));
    } catch (...) {
      fail();
    }
  }
  // Every worker acknowledges every job, those without a chunk too: the next job's fields are
  // then written only after each worker read this one's.
  while (acks_.load(std::memory_order_acquire) < threads_ - 1) spin_pause();
  in_job_ = false;
  if (failed_.load(std::memory_order_acquire)) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    std::rethrow_exception(e);
  }
}

void Team::work(int tid) {
  at::internal::ThreadIdGuard id(tid);
  uint64_t seen = 0;
  for (;;) {
    uint64_t p;
    while ((p = posted_.load(std::memory_order_acquire)) == seen) spin_pause();
    seen = p;
    if (stopping_.load(std::memory_order_relaxed)) return;
    const int64_t b = begin_ + tid * chunk_;
    if (b < end_) {
      c10::ParallelGuard guard(true);
      try {
        call_(fn_, b, std::min(end_, b + chunk_));
      } catch (...) {
        fail();
      }
    }
    acks_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void Team::stop() {
  stopping_.store(true, std::memory_order_relaxed);
  posted_.fetch_add(1, std::memory_order_release);
}

void team_run_impl(void (*serial)(void*), void* ctx) {
  if (team_turned_off() || at::get_num_threads() <= 1 || Team::leading() != nullptr ||
      omp_in_parallel() || at::in_parallel_region()) {
    serial(ctx);
    return;
  }
  Team team;
  std::exception_ptr error;
  // No num_threads clause, as at::parallel_for (ATen/ParallelOpenMP.h: GOMP's pool, #32008).
#pragma omp parallel
  {
    const int tid = omp_get_thread_num();
    if (tid == 0) {
      team.threads_ = omp_get_num_threads();  // (read by this thread alone)
      Team::leading() = &team;
      try {
        serial(ctx);
      } catch (...) {
        error = std::current_exception();
      }
      Team::leading() = nullptr;
      team.stop();
    } else {
      team.work(tid);
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace jacobi::cpu
