// One parallel region for a whole call (a decoding step's layers) instead of one per op.
//
// Why: every CPU kernel of a step splits its work with at::parallel_for, which opens an OpenMP
// region per call: ~0.6-0.8 us each on a 2-core EPYC (2026-12-05), ~13 a layer (q/k/v, the
// attention's two passes, o, two norms, gate/up, SiLU * up, down, and the 8-bit path's
// quantization of x before each linear): ~0.25 ms of a ~3.8 ms one-token step, with the worker
// threads between regions waiting in libgomp. Inside team_run the calling thread (the leader) runs
// the call's serial code; its threads stay in one region and take each parallel_for's chunks as
// the leader posts them, meeting at a spin barrier (~0.03 us there), as ggml's thread pool does.
//
// parallel_for keeps at::parallel_for's contract and split exactly (ATen/ParallelOpenMP.h: up to
// min(threads, ceil(range / grain)) chunks of ceil(range / chunks), chunk i on thread i, the whole
// range inline where it is at most the grain), so every kernel computes the same chunks, and
// at::get_thread_num() is the chunk's thread as there. Outside team_run it is at::parallel_for.
// Kernels whose results depend on neither (all of ours: "any split, any thread count" tests)
// give the same bits either way.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <exception>

namespace jacobi::cpu {

class Team {
 public:
  using Call = void (*)(const void* fn, int64_t begin, int64_t end);

  // The leader's: [begin, end) split as at::parallel_for splits it, each chunk on its thread,
  // this one's on the leader; returns when every chunk is done (rethrowing the first error).
  void run(int64_t begin, int64_t end, int64_t grain, Call call, const void* fn);

  // The team the calling thread leads (inside team_run), else nullptr.
  static Team*& leading();

 private:
  friend void team_run_impl(void (*serial)(void*), void* ctx);
  void work(int tid);  // a worker's loop: each job posted, until the leader stops
  void stop();
  void fail();  // the first error of a job kept, for the leader to rethrow

  int threads_ = 1;
  bool in_job_ = false;  // the leader is inside a job of its own (read and written by it alone)
  // The job (written by the leader before `posted_` moves on, read by workers after).
  Call call_ = nullptr;
  const void* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  alignas(64) std::atomic<uint64_t> posted_{0};  // jobs posted so far (and the stop)
  alignas(64) std::atomic<int64_t> acks_{0};     // workers done with the current job
  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
};

void team_run_impl(void (*serial)(void*), void* ctx);

// serial() on this thread with the threads of at::get_num_threads() held in one region for the
// parallel_for calls it makes (directly: a nested team_run runs serial() inline). One thread, or
// called inside a parallel region: serial() alone, its parallel_for calls at::parallel_for's.
template <typename F>
void team_run(F&& serial) {
  team_run_impl([](void* ctx) { (*static_cast<F*>(ctx))(); }, &serial);
}

// at::parallel_for, on the team's threads inside team_run (see above).
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* team = Team::leading();
  if (team == nullptr) return at::parallel_for(begin, end, grain, f);
  team->run(begin, end, grain,
            [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); }, &f);
}

}  // namespace jacobi::cpu
