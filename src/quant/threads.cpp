// A persistent thread pool (workers spin briefly, then sleep on a futex-backed atomic wait) and
// the threaded matmul on top of it.
#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "internal.hpp"
#include "moe/error.hpp"

namespace moe::quant {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
// Decode issues well over a thousand matmuls per token; waking a sleeping thread costs tens of
// microseconds, so workers spin for a while (~0.1-0.5 ms) before they sleep.
constexpr int kSpinIters = 1 << 14;
// The pool whose task this thread is running, if any: a run() from inside a task of the same pool
// executes inline instead of corrupting the run in progress.
thread_local const void* tls_running_pool = nullptr;
thread_local int tls_thread = 0;  // that task's thread index, reused by the inline run
}  // namespace

// Tasks are claimed with a CAS on one word holding (generation << 32 | next task), so a worker that
// wakes late, after its run has finished, cannot claim a task of a later run; the caller waits only
// for the tasks to be done, never for a descheduled worker to check in (the box may be busy).
struct ThreadPool::Impl {
  using Fn = std::function<void(int64_t, int)>;
  int n = 1;
  std::vector<std::thread> workers;
  std::atomic<uint64_t> generation{0};  // bumped to start a run (and to stop)
  std::atomic<uint64_t> work{0};        // (generation << 32) | next task
  std::atomic<int64_t> n_tasks{0};
  std::atomic<int64_t> done{0};
  std::atomic<const Fn*> fn{nullptr};
  std::atomic<bool> stop{false};
  std::mutex err_mu;
  std::exception_ptr err;

  void work_on(uint32_t gen, int thread) {
    const Fn* f = fn.load(std::memory_order_acquire);
    const int64_t total = n_tasks.load(std::memory_order_acquire);
    uint64_t cur = work.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(cur >> 32) != gen) return;
      const int64_t t = static_cast<int64_t>(cur & 0xFFFFFFFFu);
      if (t >= total) return;
      if (!work.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const void* outer = tls_running_pool;
      const int outer_thread = tls_thread;
      tls_running_pool = this;
      tls_thread = thread;
      try {
        (*f)(t, thread);
      } catch (...) {
        std::lock_guard<std::mutex> lock(err_mu);
        if (!err) err = std::current_exception();
      }
      tls_running_pool = outer;
      tls_thread = outer_thread;
      done.fetch_add(1, std::memory_order_acq_rel);
      cur = work.load(std::memory_order_acquire);
    }
  }

  void worker_main(int thread) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      int spins = 0;
      while ((g = generation.load(std::memory_order_acquire)) == seen) {
        if (++spins < kSpinIters) cpu_relax();
        else generation.wait(seen, std::memory_order_acquire);
      }
      seen = g;
      if (stop.load(std::memory_order_acquire)) return;
      work_on(static_cast<uint32_t>(g), thread);
    }
  }
};

ThreadPool::ThreadPool(int n_threads) : impl_(std::make_unique<Impl>()) {
  impl_->n = std::max(1, n_threads);
  impl_->workers.reserve(static_cast<size_t>(impl_->n - 1));
  for (int i = 1; i < impl_->n; ++i) impl_->workers.emplace_back([this, i] { impl_->worker_main(i); });
}

ThreadPool::~ThreadPool() {
  impl_->stop.store(true, std::memory_order_release);
  impl_->generation.fetch_add(1, std::memory_order_acq_rel);
  impl_->generation.notify_all();
  for (auto& t : impl_->workers) t.join();
}

int ThreadPool::size() const { return impl_->n; }

void ThreadPool::run(int64_t n_tasks, const std::function<void(int64_t task, int thread)>& fn) {
  if (n_tasks <= 0) return;
  Impl& p = *impl_;
  if (tls_running_pool == &p) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t, tls_thread);
    return;
  }
  if (p.n == 1 || n_tasks == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
    return;
  }
  if (n_tasks > 0x7FFFFFFF) fail(Exit::other, "quant: ThreadPool::run with {} tasks", n_tasks);
  const uint64_t gen = p.generation.load(std::memory_order_relaxed) + 1;
  p.err = nullptr;
  p.fn.store(&fn, std::memory_order_release);
  p.n_tasks.store(n_tasks, std::memory_order_release);
  p.done.store(0, std::memory_order_release);
  p.work.store(static_cast<uint64_t>(static_cast<uint32_t>(gen)) << 32, std::memory_order_release);
  p.generation.store(gen, std::memory_order_release);
  p.generation.notify_all();
  p.work_on(static_cast<uint32_t>(gen), 0);
  int spins = 0;
  while (p.done.load(std::memory_order_acquire) != n_tasks) {
    if (++spins < kSpinIters) cpu_relax();
    else std::this_thread::yield();
  }
  // Close the generation so a worker that read it late finds nothing to claim.
  p.work.store(static_cast<uint64_t>(static_cast<uint32_t>(gen + 1)) << 32 | 0xFFFFFFFFu, std::memory_order_release);
  if (p.err) {
    std::exception_ptr e = p.err;
    p.err = nullptr;
    std::rethrow_exception(e);
  }
}

namespace {

// What a matmul task needs; the std::function captures only a pointer to it, which fits its small
// buffer, so run() allocates nothing.
struct MatmulJob {
  const Matrix* W;
  const float* X;
  int64_t x_stride;
  int64_t n_tok;
  float* Y;
  int64_t y_stride;
  const uint8_t* acts;
  size_t act_stride;
  int64_t rows_per_task;
};

// Rows per task: a few tasks per thread so a slow thread does not hold up the others, rounded to
// 16 rows so a task's output covers whole cache lines.
int64_t rows_per_task(int64_t rows, int threads) {
  if (threads <= 1) return rows;
  int64_t per = (rows + threads * 4 - 1) / (threads * 4);
  per = (per + 15) / 16 * 16;
  return std::max<int64_t>(16, per);
}

}  // namespace

void matmul(const Matrix& W, const float* X, int64_t x_stride, int64_t n_tok, float* Y, int64_t y_stride,
            ActMode mode, ThreadPool& pool) {
  if (W.rows <= 0 || n_tok <= 0) return;
  if (!W.data) fail(Exit::other, "quant: matmul on a matrix without data");
  MatmulJob job{&W, X, x_stride, n_tok, Y, y_stride, nullptr, 0, rows_per_task(W.rows, pool.size())};
  const int64_t n_row_tasks = (W.rows + job.rows_per_task - 1) / job.rows_per_task;

  const MatmulJob* j = &job;
  if (mode == ActMode::exact) {
    pool.run(n_row_tasks, [j](int64_t task, int) {
      int64_t r0 = task * j->rows_per_task, r1 = std::min(j->W->rows, r0 + j->rows_per_task);
      matmul_rows_exact(*j->W, r0, r1, j->X, j->x_stride, j->n_tok, j->Y, j->y_stride);
    });
    return;
  }

  auto run_rows = [&] {
    pool.run(n_row_tasks, [j](int64_t task, int) {
      int64_t r0 = task * j->rows_per_task, r1 = std::min(j->W->rows, r0 + j->rows_per_task);
      matmul_rows_fast(*j->W, r0, r1, j->acts, j->act_stride, j->n_tok, j->Y, j->y_stride);
    });
  };
  if (act_type(W.type) == Type::F32) {  // F32 weights take the fp32 rows as they are
    job.acts = reinterpret_cast<const uint8_t*>(X);
    job.act_stride = static_cast<size_t>(x_stride) * sizeof(float);
    run_rows();
    return;
  }
  // The quantized activations live in a buffer owned by the calling thread, grown when needed and
  // reused by every later call from that thread.
  thread_local std::vector<uint8_t> scratch;
  const size_t act_stride = (act_row_bytes(W.type, W.cols) + 63) / 64 * 64;
  const size_t need = act_stride * static_cast<size_t>(n_tok) + 64;
  if (scratch.size() < need) scratch.resize(need);
  auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  job.acts = base;
  job.act_stride = act_stride;
  if (n_tok > 1 && pool.size() > 1) {
    pool.run(n_tok, [j](int64_t t, int) {
      quantize_act(j->W->type, j->X + t * j->x_stride, const_cast<uint8_t*>(j->acts) + t * j->act_stride, j->W->cols);
    });
  } else {
    for (int64_t t = 0; t < n_tok; ++t) quantize_act(W.type, X + t * x_stride, base + t * act_stride, W.cols);
  }
  run_rows();
}

}  // namespace moe::quant
