// The parallel regions of the kernels and their thread budget. Part of tridiag.cpp's translation
// unit (see lanes.h).
//
// Entry point: claim_chunks(count, chunk, worker). Work on the indices [0, count) in one parallel
// region, in chunks of `chunk` indices. Each pool thread that torch::stable::parallel_for starts
// calls worker(next) once: it sets up its workspace, then takes indices while next(i) returns true.
// The chunks are claimed one at a time from a shared counter, so a thread that runs slower takes
// fewer of them instead of holding up the others with a fixed share, as a static split does.
// claim_chunks returns when every index has been taken and worked on. The calling thread alone
// runs worker where there is one chunk or one thread, or while the thread budget (below) says so;
// else the pool does, timed, and a region in which its threads did not pay moves the budget.
// thread_budget() (tridiag.cpp: the module's one function) reports the budget.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>

#include <torch/csrc/stable/ops.h>

namespace {

// A pool thread's claims: next(i) gives the next index of its chunk, or claims the next chunk
// from the shared counter (claim_chunks, the top of this file); false when none are left.
class NextIndex {
 public:
  NextIndex(std::atomic<int64_t>& counter, int64_t count, int64_t chunk)
      : counter_(counter), count_(count), chunk_(chunk) {}
  bool operator()(int64_t& i) {
    if (at_ == end_) {
      at_ = counter_.fetch_add(chunk_);
      if (at_ >= count_) {
        at_ = end_;
        return false;
      }
      end_ = std::min(count_, at_ + chunk_);
    }
    i = at_++;
    return true;
  }

 private:
  std::atomic<int64_t>& counter_;
  const int64_t count_, chunk_;
  int64_t at_ = 0, end_ = 0;
};

// The thread budget. On a machine where another process keeps a core busy, a pool thread shares
// a core: it runs at a fraction of its speed and waits out the other process's time slices
// (milliseconds), and the region ends only when it does. Two threads then took up to twice one
// thread's time. So each region compares its wall time with the CPU time its threads spent in it,
// about what one thread would have needed: a region that took more than kStallShare of that (and
// more than kStallNs) stalled, its threads did not pay. After two stalled regions in a row (one
// alone can be a passing disturbance), regions run on the calling thread alone for a while, then
// one tries the pool again. While the tries stall, the while doubles, from kSoloMinNs to
// kSoloMaxNs; a try that does not stall brings the pool back and halves the while that the next
// stall starts (a lucky try under a lasting load does not start the doubling over). Under a
// lasting load that costs one stalled region in kSoloMaxNs; the threads come back at most
// kSoloMaxNs after the other process ends.
constexpr int64_t kStallNs = 300000;        // 0.3 ms: shorter regions are not judged
constexpr double kStallShare = 0.8;         // a region faster than 1 / 0.8 = 1.25 times one thread
constexpr int64_t kSoloMinNs = 50000000;    // 50 ms
constexpr int64_t kSoloMaxNs = 2000000000;  // 2 s
std::atomic<int64_t> g_solo_until{0};       // steady-clock ns: regions run alone until then
std::atomic<int64_t> g_solo_for{0};         // the while the next stall starts; 0: two stalls
std::atomic<int> g_stalled_in_a_row{0};
std::atomic<int64_t> g_stalled_regions{0};  // regions that saw a thread stall, for the tests

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// This thread's CPU time, or -1 where the platform cannot say (then nothing is measured).
int64_t thread_cpu_ns() {
#if defined(CLOCK_THREAD_CPUTIME_ID)
  timespec ts;
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) {
    return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  }
#endif
  return -1;
}

template <typename Worker>
void claim_chunks(int64_t count, int64_t chunk, const Worker& worker) {
  if (count <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  std::atomic<int64_t> counter{0};
  const int64_t chunks = (count + chunk - 1) / chunk;
  const bool solo = chunks == 1 || torch::stable::get_num_threads() <= 1 ||
                   wall_ns() < g_solo_until.load(std::memory_order_relaxed);
  if (solo) {
    NextIndex next(counter, count, chunk);
    worker(next);
    return;
  }
  // The region stalled where its threads did not pay: it took more than kStallShare of the CPU
  // time they spent in it, which one thread would have needed, give or take its caches (two
  // threads that share the work take about half; two of which one waits out another process's
  // time slice, or starts late, about all of it).
  std::atomic<int64_t> cpu_total{0};
  std::atomic<bool> measured{true};
  const int64_t start = wall_ns();
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t, int64_t) {
    const int64_t cpu0 = thread_cpu_ns();
    NextIndex next(counter, count, chunk);
    worker(next);
    const int64_t cpu1 = thread_cpu_ns();
    if (cpu0 < 0 || cpu1 < 0) measured.store(false, std::memory_order_relaxed);
    cpu_total.fetch_add(cpu1 - cpu0, std::memory_order_relaxed);
  });
  const int64_t wall = wall_ns() - start;
  const bool stalled = measured.load() && wall > kStallNs &&
                       static_cast<double>(wall) > kStallShare * static_cast<double>(cpu_total.load());
  if (!stalled) {
    g_stalled_in_a_row.store(0, std::memory_order_relaxed);
    const int64_t half = g_solo_for.load(std::memory_order_relaxed) / 2;
    g_solo_for.store(half < kSoloMinNs ? 0 : half, std::memory_order_relaxed);
    return;
  }
  g_stalled_regions.fetch_add(1, std::memory_order_relaxed);
  const int in_a_row = g_stalled_in_a_row.fetch_add(1, std::memory_order_relaxed) + 1;
  const int64_t last = g_solo_for.load(std::memory_order_relaxed);
  if (last > 0 || in_a_row >= 2) {  // a stall soon after others, or two stalls in a row
    const int64_t next = last > 0 ? std::min(2 * last, kSoloMaxNs) : kSoloMinNs;
    g_solo_for.store(next, std::memory_order_relaxed);
    g_solo_until.store(wall_ns() + next, std::memory_order_relaxed);
  }
}

}  // namespace
