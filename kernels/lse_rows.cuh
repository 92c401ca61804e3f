// lse_rows.cuh: what every lse kernel (kernels/fallback.cu; kernels/lse_reduce.cu to follow)
// says about one row of lse_partial: the infinities, and whether the row is empty on this rank.
#pragma once

namespace dcpkit {

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

// True when token row t is empty on this rank:
//   * no query_start_loc (nullptr): never;
//   * at or past query_start_loc[num_requests]: padding, empty on every rank;
//   * inside request i (query_start_loc[i] <= t < query_start_loc[i + 1]) whose local KV length
//     seq_lens[i] is 0 (without seq_lens: never).
// Rows before query_start_loc[0] belong to no request (not empty). query_start_loc holds
// num_requests + 1 non-decreasing offsets. The argument order is the one of the Python API:
// query_start_loc [S+1] first, then seq_lens [S].
__device__ __forceinline__ bool row_masked(int t, const int* __restrict__ query_start_loc,
                                           const int* __restrict__ seq_lens, int num_requests) {
  const int* qsl = query_start_loc;
  if (qsl == nullptr) return false;
  if (t >= qsl[num_requests]) return true;
  if (seq_lens == nullptr) return false;
  int lo = 0, hi = num_requests;  // first index in [0, S] with qsl[index] > t (qsl[S] > t)
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (qsl[mid] > t) hi = mid; else lo = mid + 1;
  }
  return lo > 0 && seq_lens[lo - 1] == 0;
}

}  // namespace dcpkit
