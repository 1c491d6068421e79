// SPDX-License-Identifier: Apache-2.0
//! @file harness.cu  The op-independent part of the tuner, compiled once: the synthetic weight fill,
//! the delay kernel, the rotation-set count, the timing loop, the near-tie rule and the record.
#include "harness.hpp"

#include <prox/core/launch.cuh>
#include <prox/core/math.hpp>
#include <prox_support/random.cuh>

PROX_NAMESPACE_BEGIN
namespace tuning {

int choose_index(const std::vector<double>& medians, double tolerance) noexcept {
  double best = HUGE_VAL;
  for (double m : medians)
    if (std::isfinite(m) && m >= 0.0 && m < best) best = m;
  if (!std::isfinite(best)) return -1;
  const double limit = best * (1.0 + tolerance);
  for (std::size_t i = 0; i < medians.size(); ++i)
    if (std::isfinite(medians[i]) && medians[i] >= 0.0 && medians[i] <= limit) return static_cast<int>(i);
  return -1;
}

namespace detail {
namespace {

//! The random streams of one matrix's seed: its values, and the magnitudes of its lines.
constexpr std::uint64_t kValueStream = 0;
constexpr std::uint64_t kLineStream = 1;

/**
 * @brief The synthetic weights of a WeightSpec of T: element i of a [rows][cols] matrix uniform in
 * [lo, hi), times 2^-e where e, uniform in [0, kMagnitudeOctaves), is drawn per row or per column
 * (`spread`) from a stream of its own; a prox_support::fill generator.
 */
template <class T>
struct SpreadUniformGen {
  std::uint64_t value_key;
  std::uint64_t line_key;
  float lo, hi;
  std::size_t cols;
  Spread spread;
  __device__ T operator()(std::size_t i) const {
    float v = lo + (hi - lo) * prox_support::uniform_at(value_key, i);
    if (spread != Spread::kNone) {
      const std::size_t line = spread == Spread::kRows ? i / cols : i % cols;
      const std::uint32_t e = prox_support::bits_at(line_key, line) % static_cast<std::uint32_t>(kMagnitudeOctaves);
      v = ldexpf(v, -static_cast<int>(e));
    }
    return prox_support::from_float<T>(v);
  }
};

//! Busy-waits `ns` nanoseconds of the global timer.
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= ns) break;
  }
}

template <class T>
Status fill_typed(void* p, const WeightSpec& s, std::uint64_t seed, cudaStream_t stream) noexcept {
  const SpreadUniformGen<T> gen{prox_support::random_key(seed, kValueStream),
                                prox_support::random_key(seed, kLineStream), s.lo, s.hi, s.cols, s.spread};
  return cuda_ok(prox_support::fill(static_cast<T*>(p), s.rows * s.cols, gen, stream));
}

//! Nearest-rank percentile of sorted values.
double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return HUGE_VAL;
  const std::size_t i = static_cast<std::size_t>(std::floor(q * static_cast<double>(sorted.size() - 1) + 0.5));
  return sorted[std::min(i, sorted.size() - 1)];
}

//! Two CUDA events per timed rep, created once.
class EventSet {
 public:
  EventSet() = default;
  EventSet(const EventSet&) = delete;
  EventSet& operator=(const EventSet&) = delete;
  ~EventSet() {
    for (cudaEvent_t e : ev_) (void)cudaEventDestroy(e);
  }
  Status create(std::size_t n) noexcept {
    while (ev_.size() < n) {
      cudaEvent_t e = nullptr;
      if (cudaEventCreate(&e) != cudaSuccess) return Status::kErrorCudaRuntime;
      ev_.push_back(e);
    }
    return Status::kSuccess;
  }
  cudaEvent_t operator[](std::size_t i) const noexcept { return ev_[i]; }

 private:
  std::vector<cudaEvent_t> ev_;
};

//! The delay before the timed launches: ~5 us of host work per timed launch is hidden behind it.
constexpr unsigned long long kSpinBaseNs = 200000ull;
constexpr unsigned long long kSpinPerLaunchNs = 20000ull;
//! At most this many rotation sets (more would not change an HBM-cold timing).
constexpr int kMaxSets = 64;
//! The rotation target where the L2 size cannot be read.
constexpr std::size_t kFallbackRotateBytes = std::size_t{100} << 20;
//! The touched bytes of a set count at least this much (a set of a tiny op is not "free").
constexpr std::size_t kMinTouchedBytes = 4096;

}  // namespace

Status fill_weights(void* p, const WeightSpec& s, std::uint64_t seed, cudaStream_t stream) noexcept {
  switch (s.elem) {
    case Elem::kF16: return fill_typed<__half>(p, s, seed, stream);
    case Elem::kBF16: return fill_typed<__nv_bfloat16>(p, s, seed, stream);
    case Elem::kF32: return fill_typed<float>(p, s, seed, stream);
    case Elem::kBits32:  // INT4 words: every nibble pattern is a valid weight
      return cuda_ok(
          prox_support::fill_bits(static_cast<std::uint32_t*>(p), s.rows * s.cols, seed, kValueStream, stream));
  }
  return Status::kErrorInvalidArgument;
}

Status launch_spin(unsigned long long ns, cudaStream_t stream) noexcept {
  return ::prox::detail::launch_kernel(spin_kernel, LaunchConfig{}, stream, ns);
}

int rotation_sets(std::size_t set_bytes, std::size_t touched_bytes, const TuneOptions& o) noexcept {
  std::size_t target = o.rotate_bytes;
  if (target == 0) {
    int dev = 0;
    int l2 = 0;
    target =
        cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) == cudaSuccess
            ? 2 * static_cast<std::size_t>(l2)
            : kFallbackRotateBytes;
  }
  touched_bytes = std::max(touched_bytes, kMinTouchedBytes);
  std::size_t n = touched_bytes >= target ? 1 : ceil_div(target, touched_bytes) + 1;
  std::size_t budget = o.max_rotate_bytes;
  std::size_t free_b = 0;
  std::size_t total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) budget = std::min(budget, free_b / 2);
  const std::size_t fit = set_bytes == 0 ? kMaxSets : std::max<std::size_t>(1, budget / set_bytes);
  n = std::min<std::size_t>({n, fit, static_cast<std::size_t>(kMaxSets)});
  return static_cast<int>(std::max<std::size_t>(n, 1));
}

Status time_candidates(std::vector<CandidateResult>& res, int nsets, const TuneOptions& o, cudaStream_t stream,
                       const std::function<Status(int, int)>& launch) {
  const int total = std::max(o.reps, kMinReps);
  const int rounds = std::max(1, std::min(o.rounds, total));
  const int per = ceil_div(total, rounds);
  const int chain = std::max(1, o.chain);
  EventSet ev;
  PROX_RETURN_IF_ERROR(ev.create(2 * static_cast<std::size_t>(per)));
  std::vector<std::vector<double>> times(res.size());
  int set = 0;
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t c = 0; c < res.size(); ++c) {
      if (!res[c].verified || res[c].status != Status::kSuccess) continue;
      Status st = Status::kSuccess;
      for (int w = 0; w < o.warmup && st == Status::kSuccess; ++w) st = launch(static_cast<int>(c), set++ % nsets);
      const unsigned long long delay_ns = kSpinBaseNs + kSpinPerLaunchNs * static_cast<unsigned long long>(per) *
                                                            static_cast<unsigned long long>(chain);
      if (st == Status::kSuccess) st = launch_spin(delay_ns, stream);
      for (int i = 0; i < per && st == Status::kSuccess; ++i) {
        if (cudaEventRecord(ev[2 * static_cast<std::size_t>(i)], stream) != cudaSuccess)
          return Status::kErrorCudaRuntime;
        for (int j = 0; j < chain && st == Status::kSuccess; ++j) st = launch(static_cast<int>(c), set++ % nsets);
        if (cudaEventRecord(ev[2 * static_cast<std::size_t>(i) + 1], stream) != cudaSuccess)
          return Status::kErrorCudaRuntime;
      }
      if (cudaStreamSynchronize(stream) != cudaSuccess) return Status::kErrorCudaRuntime;  // a kernel faulted
      if (st != Status::kSuccess) {
        res[c].status = st;
        res[c].failure = std::string("launch failed during timing: ") + to_string(st);
        continue;
      }
      for (int i = 0; i < per; ++i) {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, ev[2 * static_cast<std::size_t>(i)], ev[2 * static_cast<std::size_t>(i) + 1]) !=
            cudaSuccess)
          return Status::kErrorCudaRuntime;
        times[c].push_back(1000.0 * static_cast<double>(ms) / chain);
      }
    }
  }
  for (std::size_t c = 0; c < res.size(); ++c) {
    if (!res[c].verified || res[c].status != Status::kSuccess || times[c].empty()) {
      res[c].median_us = res[c].p20_us = res[c].p80_us = HUGE_VAL;
      res[c].reps = 0;
      continue;
    }
    std::sort(times[c].begin(), times[c].end());
    res[c].median_us = percentile(times[c], 0.5);
    res[c].p20_us = percentile(times[c], 0.2);
    res[c].p80_us = percentile(times[c], 0.8);
    res[c].reps = static_cast<int>(times[c].size());
  }
  return Status::kSuccess;
}

Status finish(Cache& cache, const Key& key, std::vector<CandidateResult>& res, const TuneOptions& o, TuneResult* out) {
  std::vector<double> medians;
  for (const auto& r : res) medians.push_back(r.median_us);
  const int chosen = choose_index(medians, o.tie_tolerance);
  bool recorded = false;
  if (chosen >= 0) {
    const CandidateResult& w = res[static_cast<std::size_t>(chosen)];
    PROX_RETURN_IF_ERROR(cache.record(key, Entry{w.policy, w.median_us, w.p20_us, w.p80_us, w.reps}, &recorded));
  }
  if (out != nullptr) {
    out->key = key;
    out->candidates = res;
    out->chosen = chosen;
    out->recorded = recorded;
  }
  if (chosen < 0) return res.empty() || res[0].status == Status::kSuccess ? Status::kErrorCudaRuntime : res[0].status;
  return Status::kSuccess;
}

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
