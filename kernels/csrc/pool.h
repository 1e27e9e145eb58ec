// A persistent thread pool for spind's CPU kernels: parallel_for over [begin, end) in contiguous static chunks.
//
// Why not at::parallel_for (OpenMP): a decode step of the default model is ~150 parallel regions of 20-200 us each.
// With OMP_WAIT_POLICY=PASSIVE (spind's default, so that a busy machine slows spind down instead of stalling it)
// every region wakes its helpers through the kernel (tens of us each), which ate the second core's gain; with ACTIVE
// the helpers spin forever and steal the core from the other worker process. Here helpers spin for a bounded time
// after each region (`SPIND_SPIN_US`, default 300 us: the gaps between a step's regions are far shorter, the gaps
// between steps often longer) and then sleep on a condition variable, so back-to-back regions cost a cache-line
// handshake and an idle worker costs nothing.
//
// Partition: thread t of T runs chunk t of [begin, end) split in T near-equal contiguous parts (grain respected), the
// caller running chunk 0. Kernels give every output element a fixed sequence of operations whatever the partition,
// so results never depend on the thread count.
//
// The thread count is torch's (at::get_num_threads(), read per call: workers change it between ops). Each calling
// thread has its own pool (thread_local), so in-process workers that run kernels concurrently never share helpers.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace spind_cpu {

class Pool {
 public:
  Pool() : spin_ns_(spin_from_env()), forks_(fork_count()) {
    static const int registered = pthread_atfork(nullptr, nullptr, [] { ++fork_count(); });
    (void)registered;
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() {
    if (forked()) {  // forked child: the helpers live in the parent only
      for (auto& t : threads_) t.detach();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      epoch_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // fn(chunk, num_chunks) on `n` threads (the caller included); returns when all are done.
  void run(int n, const std::function<void(int, int)>& fn) {
    if (n <= 1 || forked()) return fn(0, 1);  // a forked child has no helpers: run it whole
    while (static_cast<int>(threads_.size()) < n - 1) {
      const int id = static_cast<int>(threads_.size()) + 1;
      const uint64_t epoch = epoch_.load(std::memory_order_acquire);  // the helper joins from the next run on
      threads_.emplace_back([this, id, epoch] { loop(id, epoch); });
    }
    task_ = &fn;
    width_ = n;
    // every helper checks in, even one this run does not use, so none lags into the next run's fields
    pending_.store(static_cast<int>(threads_.size()), std::memory_order_relaxed);
    {
      // the epoch moves under the lock, so a helper that checked it and is about to wait cannot miss the wake-up
      std::lock_guard<std::mutex> lock(mu_);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    std::exception_ptr error;
    try {
      fn(0, n);
    } catch (...) {
      error = std::current_exception();
    }
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
    task_ = nullptr;
    if (error) std::rethrow_exception(error);
    if (helper_error_) {
      auto e = helper_error_;
      helper_error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  // forks seen by this process: a pool made before a fork has its helpers in the parent only (a per-call getpid()
  // would cost a syscall)
  static int& fork_count() {
    static int count = 0;
    return count;
  }
  bool forked() const { return fork_count() != forks_; }

  static int64_t spin_from_env() {
    const char* s = std::getenv("SPIND_SPIN_US");
    const long us = s ? std::strtol(s, nullptr, 10) : 300;
    return std::max<long>(us, 0) * 1000;
  }

  void loop(int id, uint64_t seen) {
    for (;;) {
      uint64_t now = epoch_.load(std::memory_order_acquire);
      if (now == seen) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns_);
        for (int i = 0; (now = epoch_.load(std::memory_order_acquire)) == seen; ++i) {
          _mm_pause();
          if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) break;
        }
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        now = epoch_.load(std::memory_order_acquire);
      }
      seen = now;
      if (stop_) return;
      if (id < width_) {
        try {
          (*task_)(id, width_);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu_);
          if (!helper_error_) helper_error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  const int64_t spin_ns_;
  const int forks_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  const std::function<void(int, int)>* task_ = nullptr;
  int width_ = 0;
  bool stop_ = false;
  std::exception_ptr helper_error_;
};

inline Pool& thread_pool() {
  thread_local Pool pool;
  return pool;
}

// fn(chunk_begin, chunk_end) over [begin, end) on up to torch's thread count, no chunk smaller than `grain`
// (a range of at most `grain` runs inline). Same contract as at::parallel_for.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t by_grain = std::max<int64_t>(1, n / std::max<int64_t>(grain, 1));
  const int threads = static_cast<int>(std::min<int64_t>(std::max(at::get_num_threads(), 1), by_grain));
  if (threads <= 1) return fn(begin, end);
  const std::function<void(int, int)> chunk = [&](int t, int width) {
    const int64_t lo = begin + n * t / width, hi = begin + n * (t + 1) / width;
    if (lo < hi) fn(lo, hi);
  };
  thread_pool().run(threads, chunk);
}

}  // namespace spind_cpu
