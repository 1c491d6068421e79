// SPDX-License-Identifier: Apache-2.0
//! @file test_status.cpp  Status names, the versioned namespace, the policy-list machinery.
#include "catch.hpp"

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>

#include <prox/core/launch.cuh>
#include <prox/core/math.hpp>
#include <prox/core/policy.hpp>
#include <prox/core/status.hpp>
#include <prox/version.hpp>

#include <sys/wait.h>
#include <unistd.h>

TEST_CASE("every Status has a distinct, non-empty name", "[status]") {
  std::set<std::string> names;
  // The last enumerator: extend this with the enum.
  constexpr prox::Status kLast = prox::Status::kErrorInvalidScale;
  for (int i = 0; i <= static_cast<int>(kLast); ++i) {
    const char* n = prox::to_string(static_cast<prox::Status>(i));
    REQUIRE(n != nullptr);
    CHECK(std::strlen(n) > 0);
    CHECK(std::string(n) != "unknown status");
    names.insert(n);
  }
  CHECK(names.size() == static_cast<std::size_t>(kLast) + 1);
  CHECK(std::string(prox::to_string(static_cast<prox::Status>(999))) == "unknown status");
  CHECK(prox::ok(prox::Status::kSuccess));
  CHECK_FALSE(prox::ok(prox::Status::kErrorNullPointer));
}

TEST_CASE("PROX_CHECK passes kSuccess through and aborts with one line on any other Status", "[status]") {
  int evaluated = 0;
  PROX_CHECK((++evaluated, prox::Status::kSuccess));
  CHECK(evaluated == 1);  // the expression is evaluated exactly once

  // The failure path in a child process: it must die of SIGABRT and say what failed.
  int pipe_fd[2];
  REQUIRE(pipe(pipe_fd) == 0);
  std::fflush(nullptr);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(pipe_fd[1], 2);  // stderr into the pipe
    close(pipe_fd[0]);
    PROX_CHECK(prox::Status::kErrorWorkspaceTooSmall);
    _exit(0);  // not reached when PROX_CHECK works
  }
  close(pipe_fd[1]);
  std::string err;
  char buf[256];
  for (ssize_t n; (n = read(pipe_fd[0], buf, sizeof(buf))) > 0;) err.append(buf, static_cast<std::size_t>(n));
  close(pipe_fd[0]);
  int wstatus = 0;
  REQUIRE(waitpid(pid, &wstatus, 0) == pid);
  CHECK(WIFSIGNALED(wstatus));
  CHECK((WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGABRT));
  CHECK(err.find("test_status.cpp:") != std::string::npos);
  CHECK(err.find("PROX_CHECK(prox::Status::kErrorWorkspaceTooSmall) failed: workspace too small") !=
        std::string::npos);
}

namespace {
template <int A, int B>
prox::Status status_if_equal() {
  return A == B ? prox::Status::kSuccess : prox::Status::kErrorInvalidArgument;
}
template <int A, int B>
prox::Status forward_twice(int* reached) {
  PROX_RETURN_IF_ERROR(status_if_equal<A, A>());  // commas in template arguments, no extra parentheses
  ++*reached;
  PROX_RETURN_IF_ERROR(status_if_equal<A, B>());
  ++*reached;
  return prox::Status::kSuccess;
}
}  // namespace

TEST_CASE("PROX_CHECK and PROX_RETURN_IF_ERROR take expressions with commas in template arguments", "[status]") {
  PROX_CHECK(status_if_equal<3, 3>());
  int reached = 0;
  CHECK(forward_twice<1, 1>(&reached) == prox::Status::kSuccess);
  CHECK(reached == 2);
  reached = 0;
  CHECK(forward_twice<1, 2>(&reached) == prox::Status::kErrorInvalidArgument);  // returned at the second
  CHECK(reached == 1);
}

#define PROX_TEST_STR_(x) #x
#define PROX_TEST_STR(x) PROX_TEST_STR_(x)
TEST_CASE("public symbols live in the inline namespace named by the version, prox::v<major>_<minor>_<patch>",
          "[status]") {
  CHECK(prox::PROX_ABI_NAMESPACE::to_string(prox::PROX_ABI_NAMESPACE::Status::kSuccess) == std::string("success"));
  const std::string major = std::to_string(PROX_VERSION_MAJOR), minor = std::to_string(PROX_VERSION_MINOR),
                    patch = std::to_string(PROX_VERSION_PATCH);
  CHECK(std::string(PROX_VERSION_STRING) == major + "." + minor + "." + patch);
  CHECK(std::string(PROX_TEST_STR(PROX_ABI_NAMESPACE)) == "v" + major + "_" + minor + "_" + patch);
}

namespace {
template <int V>
struct P {
  static constexpr int kValue = V;
  static std::string name() { return "p" + std::to_string(V); }
};
using List = prox::PolicyList<P<3>, P<5>, P<7>>;
}  // namespace

TEST_CASE("dispatch_policy maps a runtime index to the policy type", "[policy]") {
  static_assert(List::kSize == 3);
  static_assert(prox::PolicyAt<1, List>::kValue == 5);
  for (int i = 0; i < 3; ++i) {
    int seen = -1;
    const auto st = prox::dispatch_policy<List>(i, [&](auto p) {
      seen = decltype(p)::kValue;
      return prox::Status::kSuccess;
    });
    CHECK(st == prox::Status::kSuccess);
    CHECK(seen == 3 + 2 * i);
  }
  bool called = false;
  CHECK(prox::dispatch_policy<List>(3, [&](auto) {
          called = true;
          return prox::Status::kSuccess;
        }) == prox::Status::kErrorInvalidArgument);
  CHECK(prox::dispatch_policy<List>(-1, [&](auto) {
          called = true;
          return prox::Status::kSuccess;
        }) == prox::Status::kErrorInvalidArgument);
  CHECK_FALSE(called);
  std::string names;
  prox::for_each_policy<List>([&](auto p, int i) { names += std::to_string(i) + decltype(p)::name(); });
  CHECK(names == "0p31p52p7");
}

TEST_CASE("spread_smem_bytes: a small grid gets shared memory for at most ceil(blocks / SMs) per SM",
          "[policy]") {
  using prox::detail::spread_smem_bytes;
  // H100: 132 SMs, 228 KiB of shared memory per SM, 1 KiB reserved per block.
  constexpr int kSms = 132;
  constexpr int kSmem = 233472;
  constexpr int kReserved = 1024;
  constexpr std::size_t kStatic = 20000;
  // 192 blocks at 3 per SM: 2 per SM, i.e. 116736 bytes a block in all.
  CHECK(spread_smem_bytes(192, kSms, 3, kSmem, kStatic, kReserved) == 116736 - kStatic - kReserved);
  CHECK(spread_smem_bytes(264, kSms, 3, kSmem, kStatic, kReserved) == 116736 - kStatic - kReserved);
  CHECK(spread_smem_bytes(96, kSms, 3, kSmem, kStatic, kReserved) == std::size_t(kSmem) - kStatic - kReserved);
  // Nothing to do: the grid needs the full occupancy anyway, or the kernel fits one block per SM.
  CHECK(spread_smem_bytes(265, kSms, 3, kSmem, kStatic, kReserved) == 0);
  CHECK(spread_smem_bytes(384, kSms, 3, kSmem, kStatic, kReserved) == 0);
  CHECK(spread_smem_bytes(1000, kSms, 3, kSmem, kStatic, kReserved) == 0);
  CHECK(spread_smem_bytes(50, kSms, 1, kSmem, kStatic, kReserved) == 0);
  // Cannot be expressed: the static shared memory alone exceeds the share of the cap.
  CHECK(spread_smem_bytes(192, kSms, 3, kSmem, 120000, kReserved) == 0);
  // Degenerate inputs.
  CHECK(spread_smem_bytes(0, kSms, 3, kSmem, kStatic, kReserved) == 0);
  CHECK(spread_smem_bytes(192, 0, 3, kSmem, kStatic, kReserved) == 0);
  CHECK(spread_smem_bytes(192, kSms, 3, 0, kStatic, kReserved) == 0);
  // Every answer caps the shared-memory occupancy at exactly ceil(blocks / SMs), below the kernel's.
  for (const std::size_t st : {std::size_t{0}, std::size_t{9000}, std::size_t{45000}}) {
    for (int fit = 1; fit <= 6; ++fit) {
      for (long blocks = 1; blocks <= 6 * kSms; ++blocks) {
        const std::size_t dyn = spread_smem_bytes(blocks, kSms, fit, kSmem, st, kReserved);
        if (dyn == 0) continue;
        INFO("blocks " << blocks << ", fit " << fit << ", static " << st);
        const long cap = (blocks + kSms - 1) / kSms;
        const std::size_t per_block = st + dyn + kReserved;
        CHECK(per_block % 128 == 0);
        CHECK(cap < fit);
        CHECK(long(std::size_t(kSmem) / per_block) == cap);
      }
    }
  }
}

TEST_CASE("balanced_chunks: a grid under one wave gets shorter split-K chunks, never an empty one", "[policy]") {
  using prox::detail::balanced_chunks;
  using prox::detail::chunk_length;
  using prox::detail::max_balanced_chunks;
  using prox::detail::split_chunk_length;
  // H100, 2 blocks per SM: the batched Stage 1 on Qwen3-1.7B (48 tiles of d_ff, d_model 2048, 2048-input
  // chunks) goes from 1 chunk (48 blocks) to 4 of 512 (192 blocks; 5 would pass the 4x cap).
  CHECK(balanced_chunks(2048, 2048, 16, 48, 264) == 4);
  CHECK(chunk_length(2048, 4, 16) == 512);
  // Qwen3-8B: 96 tiles x 2 chunks = 192 blocks; 3 chunks (288) would need a second wave.
  CHECK(balanced_chunks(4096, 2048, 16, 96, 264) == 2);
  // The policy's own count keeps the policy's split: Qwen3-32B's 5120 inputs as 2048 + 2048 + 1024.
  CHECK(balanced_chunks(5120, 2048, 16, 200, 264) == 3);
  CHECK(split_chunk_length(5120, 3, 2048, 16) == 2048);
  CHECK(split_chunk_length(2048, 4, 2048, 16) == 512);
  // A grid of more than one wave keeps the policy's count (batched down GEMV, Qwen3-8B, B = 4: 384 blocks).
  CHECK(balanced_chunks(12288, 1024, 32, 32, 264) == 12);
  // The workspace bound does not depend on the device: a device with 4096 resident blocks still stops at
  // kMaxBalancedBlocks (2048 / 96 tiles = 21 chunks, not 4 x 8 = 32), and a grid past it keeps the
  // policy's count.
  CHECK(balanced_chunks(8192, 1024, 16, 96, 4096) == 21);
  CHECK(max_balanced_chunks(12288, 256, 32, 32) == 64);
  CHECK(max_balanced_chunks(25600, 256, 32, 40) == 100);
  // Degenerate device numbers: the policy's count.
  CHECK(balanced_chunks(4096, 1024, 16, 96, 0) == 4);
  CHECK(balanced_chunks(4096, 1024, 16, 0, 264) == 4);
  // Every answer: at least the policy's count, at most max_balanced_chunks, chunks no longer than the
  // policy's and aligned, every chunk non-empty, and more chunks only where the grid stays in one wave.
  for (const int align : {16, 32}) {
    for (const int max_chunk : {256, 1024, 2048}) {
      for (int k = align; k <= 6000; k += align * 7 + 8 * (k % 3)) {
        for (const long tiles : {1L, 3L, 32L, 96L, 200L}) {
          for (const long slots : {132L, 264L, 528L}) {
            INFO("k " << k << ", max_chunk " << max_chunk << ", align " << align << ", tiles " << tiles
                      << ", slots " << slots);
            const int nominal = (k + max_chunk - 1) / max_chunk;
            const int n = balanced_chunks(k, max_chunk, align, tiles, slots);
            const int len = split_chunk_length(k, n, max_chunk, align);
            CHECK(len == (n == nominal ? max_chunk : chunk_length(k, n, align)));
            CHECK(n >= nominal);
            CHECK(n <= max_balanced_chunks(k, max_chunk, align, tiles));
            if (n > nominal) CHECK(tiles * n <= prox::detail::kMaxBalancedBlocks);
            CHECK(len <= max_chunk);
            CHECK(len % align == 0);
            CHECK(long(n - 1) * len < k);  // the last chunk holds at least one coordinate
            CHECK(long(n) * len >= k);      // and the chunks cover k
            if (n > nominal) CHECK(tiles * n <= slots);
          }
        }
      }
    }
  }
}

TEST_CASE("cached_for_device: one driver query per device, failures not cached", "[policy]") {
  using prox::Status;
  static std::atomic<int> cache[prox::detail::kMaxCachedDevices];
  int calls = 0;
  bool fail = false;
  const auto compute = [&](int dev, int* v) {
    ++calls;
    if (fail) return Status::kErrorCudaRuntime;
    *v = 100 + dev;  // any value, 0 included, must come back as computed
    return Status::kSuccess;
  };
  int out = -1;
  fail = true;
  CHECK(prox::detail::cached_for_device(cache, 3, compute, &out) == Status::kErrorCudaRuntime);
  CHECK(out == -1);
  fail = false;
  REQUIRE(prox::detail::cached_for_device(cache, 3, compute, &out) == Status::kSuccess);  // retried
  CHECK(out == 103);
  CHECK(calls == 2);
  fail = true;  // a cached value is read without calling compute again
  REQUIRE(prox::detail::cached_for_device(cache, 3, compute, &out) == Status::kSuccess);
  CHECK(out == 103);
  CHECK(calls == 2);
  fail = false;  // each device has its own entry
  REQUIRE(prox::detail::cached_for_device(cache, 0, [](int, int* v) { *v = 0; return Status::kSuccess; }, &out) ==
          Status::kSuccess);
  CHECK(out == 0);
  REQUIRE(prox::detail::cached_for_device(cache, 0, compute, &out) == Status::kSuccess);
  CHECK(out == 0);  // the cached 0, not 100
  CHECK(calls == 2);
  // A device beyond the cache is computed every time.
  const int beyond = prox::detail::kMaxCachedDevices;
  REQUIRE(prox::detail::cached_for_device(cache, beyond, compute, &out) == Status::kSuccess);
  REQUIRE(prox::detail::cached_for_device(cache, beyond, compute, &out) == Status::kSuccess);
  CHECK(out == 100 + beyond);
  CHECK(calls == 4);
}
