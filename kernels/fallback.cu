// fallback.cu: the local kernels of the NCCL versions of the three ops (dcpkit/nccl/) and the
// strided copy (dcpkit/_strided.py).
//
// The exchanges themselves are NCCL calls; these kernels only move data between the layouts
// NCCL needs (contiguous per-peer blocks) and the layouts of the op arguments, and compute the
// LSE weights of the all-gather-lse algorithms of lse_reduce:
//   * fallback_copy_kernel<E>          strided 4-D copy of E elements (pack, head reorder)
//   * fallback_lse_mask_kernel<L>      lse_partial -> float32 natural log, masked, in owner order
//   * fallback_lse_weight_kernel<O>    y = w_rank * out_partial (fp32), zero where w == 0
//   * fallback_cast_kernel<O>          fp32 -> output dtype, strided destination
// None of them waits on a peer: they are ordinary grid-stride kernels, any grid size works.
#include "dcpkit_ptx.cuh"
#include "lse_rows.cuh"

namespace dcpkit {

// float64 lse_partial is accepted by the NCCL path only (the direct kernels take 16/32-bit).
__device__ __forceinline__ float to_float(double x) { return static_cast<float>(x); }

// ----------------------------------------------------------------------------- copy
// dst[i0, i1, i2, i3] = src[i0, i1, i2, i3] over the box [n0, n1, n2, n3]. Strides are in
// elements of E (the host picks E as wide as the alignment of both sides allows: up to uint4).
template <typename E>
__global__ void fallback_copy_kernel(E* __restrict__ dst, const E* __restrict__ src,
                                     long long n0, long long n1, long long n2, long long n3,
                                     long long ds0, long long ds1, long long ds2, long long ds3,
                                     long long ss0, long long ss1, long long ss2, long long ss3) {
  const long long n = n0 * n1 * n2 * n3;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    long long r = i;
    const long long i3 = r % n3;
    r /= n3;
    const long long i2 = r % n2;
    r /= n2;
    const long long i1 = r % n1;
    const long long i0 = r / n1;
    dst[i0 * ds0 + i1 * ds1 + i2 * ds2 + i3 * ds3] = src[i0 * ss0 + i1 * ss1 + i2 * ss2 + i3 * ss3];
  }
}

// ----------------------------------------------------------------------------- lse mask
// row_masked(t, query_start_loc, seq_lens, S): kernels/lse_rows.cuh.

// dst[s*dst_ss + t*dst_st + j] = lse of row t, head h = s*H_r + j: converted to float32, times
// `scale` (ln(lse_base)), NaN and +inf replaced by -inf (an empty or invalid shard), masked rows
// -inf. qsl == nullptr: no mask. dst layouts: owner-major [W, T, H_r] (dst_ss = T*H_r,
// dst_st = H_r) for the all_to_all, or [T, H] (dst_ss = H_r, dst_st = H) for the all-gathers.
template <typename L>
__global__ void fallback_lse_mask_kernel(float* __restrict__ dst, long long dst_ss,
                                         long long dst_st, const L* __restrict__ lse,
                                         long long lse_st, long long lse_sh,
                                         const int* __restrict__ qsl,
                                         const int* __restrict__ seq_lens, int num_requests,
                                         int T, int H, int H_r, float scale) {
  const long long n = static_cast<long long>(T) * H;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    const int t = static_cast<int>(i / H);
    const int h = static_cast<int>(i - static_cast<long long>(t) * H);
    float v = to_float(lse[t * lse_st + h * lse_sh]);
    if (!(v < pos_inf())) v = neg_inf();  // NaN and +inf
    v *= scale;                            // -inf stays -inf (scale > 0)
    if (row_masked(t, qsl, seq_lens, num_requests)) v = neg_inf();
    const int s = h / H_r;
    const int j = h - s * H_r;
    dst[s * dst_ss + t * dst_st + j] = v;
  }
}

// ----------------------------------------------------------------------------- weights
// One warp per (t, h) row of out_partial. From the gathered, masked lse of every source
// lse_all [W, T, H]:
//   m = max_s l_s;  sum = sum_s exp(l_s - m);  w = exp(l_rank - m) / sum  (0 when m == -inf)
//   y[row] = w * x[row] in fp32, and exactly 0 when w == 0 (x is then never read: it may be NaN)
// y of head h = s*H_r + j, token t, element d sits at y[s*y_ss + t*y_st + j*D + d]: owner-major
// [W, T, H_r, D] (y_ss = T*H_r*D, y_st = H_r*D) for a reduce-scatter, [T, H, D] (y_ss = H_r*D,
// y_st = H*D) for an all-reduce. Rows with h in [lse_h0, lse_h1) also get the merged lse
// m + log(sum) (-inf when m == -inf) at lse_out[t*lse_out_st + h - lse_h0] (lse_out may be null).
template <typename O>
__global__ void fallback_lse_weight_kernel(float* __restrict__ y, long long y_ss, long long y_st,
                                           const O* __restrict__ x, long long x_st,
                                           long long x_sh, long long x_sd,
                                           const float* __restrict__ lse_all,
                                           float* __restrict__ lse_out, long long lse_out_st,
                                           int lse_h0, int lse_h1, int world_size, int rank,
                                           int T, int H, int H_r, int D) {
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
  const long long rows = static_cast<long long>(T) * H;
  for (long long row = warp; row < rows; row += num_warps) {
    const int t = static_cast<int>(row / H);
    const int h = static_cast<int>(row - static_cast<long long>(t) * H);
    float m = neg_inf();
    for (int s = 0; s < world_size; ++s) m = fmaxf(m, lse_all[s * rows + row]);
    float w = 0.f, sum = 0.f;
    if (m > neg_inf()) {
      for (int s = 0; s < world_size; ++s) sum += expf(lse_all[s * rows + row] - m);
      w = expf(lse_all[rank * rows + row] - m) / sum;
    }
    const int s_own = h / H_r;
    const int j = h - s_own * H_r;
    float* yr = y + s_own * y_ss + t * y_st + static_cast<long long>(j) * D;
    if (w > 0.f) {
      const O* xr = x + t * x_st + h * x_sh;
      for (int d = lane; d < D; d += 32) yr[d] = w * to_float(xr[d * x_sd]);
    } else {
      for (int d = lane; d < D; d += 32) yr[d] = 0.f;
    }
    if (lse_out != nullptr && lane == 0 && h >= lse_h0 && h < lse_h1) {
      lse_out[t * lse_out_st + (h - lse_h0)] = (m > neg_inf()) ? m + logf(sum) : neg_inf();
    }
  }
}

// ----------------------------------------------------------------------------- cast
// out[t, h, d] = (O) y[t, h, d] with y contiguous [T, Hx, D] fp32 and out strided (elements).
template <typename O>
__global__ void fallback_cast_kernel(O* __restrict__ out, long long o_st, long long o_sh,
                                     long long o_sd, const float* __restrict__ y, int T, int Hx,
                                     int D) {
  const long long n = static_cast<long long>(T) * Hx * D;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    const long long d = i % D;
    const long long r = i / D;
    const long long h = r % Hx;
    const long long t = r / Hx;
    out[t * o_st + h * o_sh + d * o_sd] = from_float<O>(y[i]);
  }
}

}  // namespace dcpkit
