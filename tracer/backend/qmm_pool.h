// qmm's thread pool: the chunks of one job at a time, pulled from one
// counter by the caller and sleeping workers (as the BLAS shim splits its
// GEMMs, blas_shim.c). Included by qmm.cpp inside its anonymous namespace.

// How long an idle thread spins before it sleeps: longer than the gaps
// between one decode step's pool jobs (a layer's last matmul, its small
// nodes, the next layer's attention: 20-60 us), since on this machine's VM
// a sleeping thread takes ~60 us to wake and a job's chunks meanwhile run on
// the caller alone (a bucket-8 step's attention: 2.8 -> 2.1-2.4 ms with
// 200 us). In-process A/B on pipelined generation (benchmarks/contention.py
// too, beside two busy processes: not slower): 100 us 3-7 % faster than 20
// at buckets 1 and 8, 60 and 200 alike.
constexpr long kSpinNs = 100000;
// An idle worker (waiting for the next job, not for a job's last chunks)
// spins yielding its core (sched_yield every 64 pauses) to whichever thread
// is ready to run there: on 2 cores the kernels' two threads share them with
// the Python thread that builds the next steps (~3-4 ms of CPU a bucket-1
// step of ~9), which otherwise waited for a core while the worker spun. The
// caller waiting for a job's last chunks spins as before (it is the step's
// critical path: given away, its core could come back a time slice later).
// 0.5.38, SmolLM2 quantized-split, in-process A/B (a scratch switch, load
// 1.0-1.9): bucket-1 generation (96 tokens, alternating rounds) 146.7 ->
// 150.0 and 141.1 -> 151.6 tok/s; loops of decode steps at 128 positions,
// old / new time: bucket 1 1.02-1.14x (the caller's waits yielding too:
// 1.08-1.11x), bucket 8 1.04x, bucket-1 verify windows of 5 1.04x and
// 1.07x, bucket-1 steps each evaluated before the next is built 1.06x.

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A word threads wait on to change: a bounded spin, then a futex sleep. Who
// changes it calls the futex only while someone sleeps (one syscall less a
// job where the waiters still spin): a sleeper counts itself before it reads
// the word a last time, the changer reads the count after its store (both
// sequentially consistent, so one of them sees the other).
struct Signal {
  std::atomic<uint32_t> word{0};
  std::atomic<int> sleepers{0};

  // Waits until word != seen; returns the new value. `idle`: a worker
  // between jobs, whose spin yields its core (kSpinNs).
  uint32_t wait_change(uint32_t seen, bool idle = false) {
    const long until = now_ns() + kSpinNs;
    for (int i = 1;; ++i) {
      const uint32_t v = word.load(std::memory_order_acquire);
      if (v != seen) return v;
      cpu_relax();
      if ((i & 63) == 0) {
        if (now_ns() > until) break;
        if (idle) sched_yield();
      }
    }
    sleepers.fetch_add(1);
    uint32_t v;
    while ((v = word.load()) == seen) word.wait(seen);
    sleepers.fetch_sub(1);
    return v;
  }
  void store(uint32_t v) {
    word.store(v);
    if (sleepers.load() > 0) word.notify_all();
  }
  // word + 1 (returned), waking sleepers.
  uint32_t increment() {
    const uint32_t v = word.fetch_add(1) + 1;
    if (sleepers.load() > 0) word.notify_all();
    return v;
  }
};

int default_threads() {
  if (const char* env = std::getenv("MLX_TRACER_QMM_THREADS"); env && std::atoi(env) > 0) return std::atoi(env);
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
}

// Runs the chunks of one job at a time on the caller and up to threads - 1
// workers, each chunk taken from one counter (the job word: generation << 32
// | chunk count << 16 | next chunk). A caller that finds the pool busy, or a
// one-thread pool, runs the same chunks itself, one after another.
class Pool {
 public:
  using Fn = void (*)(const void* ctx, int chunk);
  static constexpr int kMaxChunks = 0xffff;

  Pool() : threads_(default_threads()) {
    pthread_atfork(nullptr, nullptr, [] { the().after_fork(); });
  }
  static Pool& the() {
    static Pool* pool = new Pool;  // never destroyed: detached workers use it until exit
    return *pool;
  }
  int threads() const { return threads_.load(); }
  void set_threads(int n) { threads_.store(std::max(1, n)); }

  // Runs fn(ctx, 0 .. count); on the caller alone where `alone`.
  void run(int count, Fn fn, const void* ctx, bool alone = false) {
    const int helpers = alone || count < 2 || threads() < 2 || !lock_.try_lock() ? 0 : start(threads() - 1);
    if (helpers == 0) {
      for (int i = 0; i < count; ++i) fn(ctx, i);
      return;
    }
    fn_ = fn, ctx_ = ctx;
    gen_ = gen_ + 1 == 0 ? 1 : gen_ + 1;  // 0 is every worker's first "seen"
    done_.word.store(0);
    word_.store(uint64_t(gen_) << 32 | uint64_t(count) << 16, std::memory_order_release);
    wake_.store(gen_);
    take(gen_);
    for (uint32_t d = done_.word.load(); d != uint32_t(count);) d = done_.wait_change(d);
    lock_.unlock();
  }

 private:
  // Workers running, started up to n (under lock_); 0 where none could start.
  int start(int n) {
    while (started_ < n) {
      try {
        std::thread([this] { work(); }).detach();
      } catch (const std::system_error&) {
        break;
      }
      ++started_;
    }
    if (started_ == 0) lock_.unlock();
    return started_;
  }
  void work() {
    for (uint32_t seen = 0;;) {
      seen = wake_.wait_change(seen, true);
      take(seen);
    }
  }
  // Takes and runs chunks of generation gen until none is left.
  void take(uint32_t gen) {
    uint64_t v = word_.load(std::memory_order_acquire);
    for (;;) {
      const int count = int(v >> 16 & 0xffff), next = int(v & 0xffff);
      if (uint32_t(v >> 32) != gen || next >= count) return;
      if (!word_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      fn_(ctx_, next);  // the job cannot finish (nor fn_ change) before this chunk is done
      done_.increment();
      v = word_.load(std::memory_order_acquire);
    }
  }
  void after_fork() {  // the child has the pool's memory but none of its threads
    new (&lock_) std::mutex;
    started_ = 0;
    gen_ = 0;
    word_.store(0), wake_.word.store(0), done_.word.store(0), wake_.sleepers.store(0), done_.sleepers.store(0);
  }

  std::mutex lock_;
  std::atomic<int> threads_;
  int started_ = 0;
  uint32_t gen_ = 0;
  Fn fn_ = nullptr;
  const void* ctx_ = nullptr;
  alignas(64) std::atomic<uint64_t> word_{0};
  alignas(64) Signal done_;  // chunks finished
  alignas(64) Signal wake_;  // the generation of the job on offer
};
