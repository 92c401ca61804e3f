// lse_rows.cuh: what every lse kernel (kernels/fallback.cu, kernels/lse_reduce.cu)
// says about one row of lse_partial: the infinities, and whether the row is empty on this rank.
#pragma once

namespace dcpkit {

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

// Whether token rows t[0..R) are empty on this rank:
//   * no query_start_loc (nullptr): never;
//   * at or past query_start_loc[num_requests]: padding, empty on every rank;
//   * inside request i (query_start_loc[i] <= t < query_start_loc[i + 1]) whose local KV length
//     seq_lens[i] is 0 (without seq_lens: never).
// Rows before query_start_loc[0] belong to no request (not empty). query_start_loc holds
// num_requests + 1 non-decreasing offsets. The argument order is the one of the Python API:
// query_start_loc [S+1] first, then seq_lens [S]. The search (first index in [0, S] with
// query_start_loc[index] > t) is branchless with a trip count that depends on S only, so the
// loads of the R searches are in flight together: ceil(log2(S + 1)) + 1 dependent rounds for
// all R rows, not per row.
template <int R>
__device__ __forceinline__ void rows_masked(const int (&t)[R], const int* query_start_loc,
                                            const int* seq_lens, int num_requests,
                                            bool (&masked)[R]) {
  const int* qsl = query_start_loc;
  const int S = num_requests;
#pragma unroll
  for (int r = 0; r < R; ++r) masked[r] = false;
  if (qsl == nullptr) return;
  const int end = __ldg(qsl + S);
  int base[R];
#pragma unroll
  for (int r = 0; r < R; ++r) base[r] = 0;
  if (seq_lens != nullptr) {
    for (int n = S + 1; n > 1;) {  // upper bound of t in qsl[0 .. S]
      const int half = n >> 1;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (__ldg(qsl + base[r] + half) <= t[r]) base[r] += half;
      }
      n -= half;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (__ldg(qsl + base[r]) <= t[r]) base[r] += 1;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (t[r] >= end) {
      masked[r] = true;
    } else if (seq_lens != nullptr) {
      masked[r] = base[r] > 0 && __ldg(seq_lens + base[r] - 1) == 0;
    }
  }
}

// One row of rows_masked.
__device__ __forceinline__ bool row_masked(int t, const int* query_start_loc,
                                           const int* seq_lens, int num_requests) {
  const int ts[1] = {t};
  bool m[1];
  rows_masked<1>(ts, query_start_loc, seq_lens, num_requests, m);
  return m[0];
}

}  // namespace dcpkit
