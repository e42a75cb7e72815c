// arfuse: the shape of a communicator's Lamport buffer, shared by the kernel (kernel.cuh, which
// indexes it) and the host (which sizes and allocates it). Plain C++: no CUDA or torch types.
//
// A rank's buffer holds kNumSlots slots; call c of a communicator uses slot c % kNumSlots (the
// epoch in Ctrl). A slot holds rows of H elements of the activation dtype, every element the
// sentinel (-0.0) until a peer writes it, and reset to the sentinel by its reader right after
// it is read (docs/design.md). Within a slot, for a call of T tokens over N ranks:
//   one-shot: the partial row of token t from rank r is row oneshot_row(t, r, N)       (t < T)
//   two-shot: the partial of owner-local token l from rank r is row twoshot_partial_row(l, r, N)
//             (l < per = ceil(T / N)); token t's reduced row, gathered from its owner, is row
//             twoshot_gather_row(t, per, N)
// (kernel.cuh computes the same offsets inline: slot_off + row * H.)
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ARFUSE_HD __host__ __device__
#else
#define ARFUSE_HD
#endif

namespace arfuse {

constexpr int kNumSlots = 3;  // Lamport slots: call c uses slot c % 3

// Per-rank control block in device memory (one per communicator).
struct Ctrl {
  uint32_t epoch;            // slot of the next call: (completed calls) mod 3, kept in 0..2 so it
                             // never wraps onto a slot that was not cleared
  uint32_t arrived;          // blocks of the current call that have finished
  uint32_t error;            // device copy of the error word: once set, every later call skips
                             // its waits and writes NaN (a late peer write cannot pass as data)
  uint32_t pad;
};

ARFUSE_HD constexpr int64_t oneshot_row(int64_t t, int64_t r, int64_t N) { return t * N + r; }
ARFUSE_HD constexpr int64_t twoshot_tokens_per_owner(int64_t T, int64_t N) { return (T + N - 1) / N; }
ARFUSE_HD constexpr int64_t twoshot_partial_row(int64_t l, int64_t r, int64_t N) { return l * N + r; }
ARFUSE_HD constexpr int64_t twoshot_gather_row(int64_t t, int64_t per, int64_t N) {
  return per * N + t;
}

// Rows one slot needs so that every call a communicator accepts fits: one-shot calls carry at
// most oneshot_cap tokens (rows 0 .. N * oneshot_cap - 1), two-shot calls at most max_tokens
// (rows 0 .. per * N + max_tokens - 1 with per = ceil(max_tokens / N)).
ARFUSE_HD constexpr int64_t rows_per_slot(int64_t N, int64_t max_tokens, int64_t oneshot_cap) {
  const int64_t oneshot = oneshot_row(oneshot_cap, 0, N);
  const int64_t twoshot =
      twoshot_gather_row(max_tokens, twoshot_tokens_per_owner(max_tokens, N), N);
  return oneshot > twoshot ? oneshot : twoshot;
}

// Examples of the rules above: the last row of each layout is inside the slot (one-shot: T = 7
// tokens, N = 8; two-shot: T = 8192, N = 16), and the two-shot partials end where the gathered
// rows begin.
static_assert(oneshot_row(6, 7, 8) == rows_per_slot(8, 7, 7) - 1, "one-shot rows and the slot");
static_assert(twoshot_gather_row(8191, twoshot_tokens_per_owner(8192, 16), 16) ==
                  rows_per_slot(16, 8192, 0) - 1, "two-shot rows and the slot");
static_assert(twoshot_partial_row(511, 15, 16) + 1 == twoshot_gather_row(0, 512, 16),
              "two-shot partials and gathered rows");

}  // namespace arfuse
