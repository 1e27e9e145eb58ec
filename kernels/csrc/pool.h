// A persistent thread pool for spind's CPU kernels: parallel_for over [begin, end) in chunks that threads claim.
//
// Why not at::parallel_for (OpenMP): a decode step of the default model is ~150 parallel regions of 20-200 us each.
// With OMP_WAIT_POLICY=PASSIVE (spind's default, so that a busy machine slows spind down instead of stalling it)
// every region wakes its helpers through the kernel (tens of us each), which ate the second core's gain; with ACTIVE
// the helpers spin forever and steal the core from the other worker process. Here helpers spin for a bounded time
// after each region (`SPIND_SPIN_US`, default 300 us: the gaps between a step's regions are far shorter, the gaps
// between steps often longer) and then sleep on a condition variable, so back-to-back regions cost a cache-line
// handshake and an idle worker costs nothing.
//
// Partition: [begin, end) is split in T near-equal contiguous chunks (grain respected), and the chunks are *claimed*,
// not assigned: the caller and each helper take the next unclaimed chunk until none is left, and the caller waits
// only for chunks that were claimed and are running. So a helper the OS has not scheduled (another process wants
// the core: the coordinator, a drafter, a neighbour) costs nothing: the caller runs its chunk too, at one thread's
// speed, instead of spinning until the helper is back (with static chunks a preempted helper held every region for
// a scheduler slice: 2-thread steps were seen 10x slower than 1-thread ones while another process ran). A late
// helper finds the region gone (its epoch is in the claim word) and waits for the next. Kernels give every output
// element a fixed sequence of operations whatever the partition and whoever runs a chunk, so results never depend
// on the thread count or on scheduling.
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

  // fn(chunk, num_chunks) for every chunk of `n`, on up to `n` threads (the caller included); returns when all
  // are done.
  void run(int n, const std::function<void(int, int)>& fn) {
    if (n <= 1 || forked()) return fn(0, 1);
    while (static_cast<int>(threads_.size()) < n - 1) {
      const uint64_t epoch = epoch_.load(std::memory_order_acquire);  // the helper joins from the next run on
      threads_.emplace_back([this, epoch] { loop(epoch); });
    }
    const uint64_t epoch = epoch_.load(std::memory_order_relaxed) + 1;
    task_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    claim_.store(pack(epoch, n, 0), std::memory_order_release);  // the chunks of this run are claimable from here
    {
      // the epoch moves under the lock, so a helper that checked it and is about to wait cannot miss the wake-up
      std::lock_guard<std::mutex> lock(mu_);
      epoch_.store(epoch, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    work(epoch);
    wait_done(n);
    task_ = nullptr;
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  // The claim word: the run's epoch (high 32 bits), its number of chunks (16) and the next unclaimed chunk (16).
  static uint64_t pack(uint64_t epoch, int width, int next) {
    return (epoch << 32) | (static_cast<uint64_t>(width) << 16) | static_cast<uint64_t>(next);
  }

  // Claim and run chunks of run `epoch` until none is left (or that run is over).
  void work(uint64_t epoch) {
    uint64_t cur = claim_.load(std::memory_order_acquire);
    for (;;) {
      const int width = static_cast<int>((cur >> 16) & 0xFFFF), next = static_cast<int>(cur & 0xFFFF);
      if ((cur >> 32) != (epoch & 0xFFFFFFFFu) || next >= width) return;
      if (!claim_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      try {
        (*task_)(next, width);  // task_ is this run's: it cannot end before this chunk is done
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == width && waiting_.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lock(mu_);
        done_cv_.notify_one();
      }
      cur = claim_.load(std::memory_order_acquire);
    }
  }

  // The caller waits for the chunks helpers claimed: spinning for a while (they are running, and nearly done), then
  // asleep. Sleeping matters when a helper was preempted mid-chunk by another process: a spinning caller keeps its
  // core busy so the OS never moves the helper onto it, and the region lasts the other process's time slice; a
  // sleeping caller leaves its core idle, the helper migrates there at once and wakes the caller when done.
  void wait_done(int n) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kWaitSpinNs);
    for (int i = 0; done_.load(std::memory_order_seq_cst) != n; ++i) {
      _mm_pause();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) {
        std::unique_lock<std::mutex> lock(mu_);
        waiting_.store(true, std::memory_order_seq_cst);
        done_cv_.wait(lock, [&] { return done_.load(std::memory_order_seq_cst) == n; });
        waiting_.store(false, std::memory_order_relaxed);
        return;
      }
    }
  }
  static constexpr int64_t kWaitSpinNs = 50'000;

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

  void loop(uint64_t seen) {
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
      work(now);
    }
  }

  const int64_t spin_ns_;
  const int forks_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;       // helpers wait here for a run
  std::condition_variable done_cv_;  // the caller waits here for its run's last chunks
  std::atomic<uint64_t> epoch_{0};
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> waiting_{false};  // the caller sleeps on done_cv_
  const std::function<void(int, int)>* task_ = nullptr;
  bool stop_ = false;
  std::exception_ptr error_;
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
