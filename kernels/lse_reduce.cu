// lse_reduce.cu: the direct all-to-all of partial attention outputs with the log-sum-exp (LSE)
// weighted merge, in one launch per call. Python side: dcpkit/ops/lse_reduce.py. Reference:
// dcpkit/reference.py::lse_reduce_reference.
//
// Every rank r holds out_partial [T, H, D_v] and lse_partial [T, H] (attention of all heads over
// its KV shard). Rank d owns heads [d*H_r, (d+1)*H_r). One kernel per call:
//   1. send     every CTA, warps grid-stride over rows (destination d, token t, local head h):
//               the row out_partial[t, d*H_r + h] goes (16-byte stores) to slot row [r][t][h] on
//               rank d, its lse (natural log, sanitised, -inf when the row is masked) to the lse
//               slot [r][t][h]. A row whose lse is -inf sends no payload.
//   2. publish  arrive_and_publish: CTA barrier, arrival (last-CTA election), the elected CTA
//               stores the new epoch and the signal word into signals[slot][r] of every rank
//               (this one included) after one fence.acq_rel.sys.
//   3. combine  the last K CTAs to arrive (K = min(grid, waiter_ctas)) wait for all sources
//               (its own rank included: that signal says every CTA of this kernel finished its
//               stores); the other CTAs help if every signal is there within kHelpNs, else exit.
//               They claim units of kUnitItems items (t, h) from the call's work counter:
//               out = sum_s w_s * payload_s in fp32, rounded once; merged lse = m + log(sum).
// See NOTE [dcpkit epoch signalling] in dcpkit_ptx.cuh for why slots can be reused without a
// barrier, and for the co-residency rule that bounds the waiting CTAs.
//
// Slot layout on the owner rank (slot p = epoch & 1, base = peer_data[owner] + p * slot_bytes):
//   payload  OUT_T [W src][T_max][H_r][D_v]
//   lse      float [W src][T_max][H_r]          at base + lse_offset
//
// lse_combine_kernel is the same merge over local arrays (src_out [W][T][H_r][D_v], src_lse
// [W][T][H_r]); the NCCL fallback runs it after its all_to_all. Both kernels share combine_rows.

#include "dcpkit_ptx.cuh"
#include "lse_rows.cuh"

namespace dcpkit {
namespace lse_detail {

constexpr int kThreads = 256;                 // block size of both kernels (host: THREADS)
constexpr int kWarps = kThreads / 32;
constexpr int kMaxSources = 64;               // world_size limit of the merge (host checks)
constexpr int kSendRows = 4;                  // rows of one warp in flight when sending
constexpr int kSendBatch = 2;                 // 16-byte vectors per lane and row per send step
constexpr int kItemsPerWarp = 4;              // merge items (t, h) of one warp in flight
constexpr int kSrcBatch = 2;                  // sources per merge step (loads in flight per
                                              // lane: kItemsPerWarp * kSrcBatch)
constexpr int kUnitItems = kWarps * kItemsPerWarp;  // items of one claimed unit of the combine

// NaN and +inf mean an empty or invalid shard: both become -inf.
__device__ __forceinline__ float sanitize_lse(float l) { return (l < pos_inf()) ? l : neg_inf(); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// rows_masked(t, query_start_loc, seq_lens, S, masked) and the infinities: kernels/lse_rows.cuh.

// The merge, shared by both kernels. Items (t, h) in [0, T*H_r) go in groups of kItemsPerWarp
// consecutive items to the warps of CTAs [0, ncta) (this one is `cta`), grid-stride: warp g of
// them takes the groups g, g + ncta * kWarps, ...
//   payload : source 0, item 0 of [W][T_cap][H_r][D_v] OUT_T (src_stride_bytes between sources)
//   lse     : source 0, item 0 of [W][T_cap][H_r] float (src_lse_stride elements between sources)
//   out     : [T][H_r][D_v] contiguous, 16-byte aligned rows; out_lse: [T][H_r] or null.
// Source lse values are sanitised again here (the local kernel gets them straight from NCCL).
// A source with weight 0 is never read: its payload may hold anything, NaN included.
// Latency: a group costs one round of lse loads (every source of every item of the group at
// once), the warp reductions of its items interleaved, then ceil(D_v * size / 512) x
// ceil(W / kSrcBatch) rounds of payload loads, each with the loads of every item of the group in
// flight (a source's weight comes from a shuffle, so nothing waits on shared memory). Per item the
// arithmetic is the one of the naive merge, in the same order (max, exp, sum, weights, fma over
// the sources in source order, one rounding).
template <typename OUT_T>
__device__ __forceinline__ void combine_rows(const char* payload, u64 src_stride_bytes,
                                             const float* lse, u64 src_lse_stride, int W, int T,
                                             int H_r, int D_v, OUT_T* out, float* out_lse,
                                             int cta, int ncta) {
  constexpr int E = vec_elems<OUT_T>::value;
  constexpr int R = kItemsPerWarp;
  static_assert(kMaxSources <= 64, "a lane holds the lse of two sources at most");
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int wib = static_cast<int>(threadIdx.x >> 5);
  const int nwarps = ncta * kWarps;
  const int items = T * H_r;
  const u64 row_bytes = static_cast<u64>(D_v) * sizeof(OUT_T);
  const int nvec = static_cast<int>(row_bytes / 16);

  // Warp-uniform loop: every lane runs every iteration (the shuffles need the whole warp).
  for (int g0 = (cta * kWarps + wib) * R; g0 < items; g0 += nwarps * R) {
    // 1. The lse of every source of the R items (lane holds sources lane and lane + 32; W <= 64).
    float l0[R], l1[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int item = g0 + r;
      l0[r] = neg_inf();
      l1[r] = neg_inf();
      if (item < items) {
        if (lane < W) {
          l0[r] = sanitize_lse(ld_cg_f32(lse + static_cast<u64>(lane) * src_lse_stride + item));
        }
        if (lane + 32 < W) {
          l1[r] = sanitize_lse(
              ld_cg_f32(lse + static_cast<u64>(lane + 32) * src_lse_stride + item));
        }
      }
    }
    // 2. Max, exp, sum, weights (w0 / w1: weights of sources lane / lane + 32; all 0 for an
    // item whose every source is empty, or past the end).
    float w0[R], w1[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float m = warp_max(fmaxf(l0[r], l1[r]));
      const bool empty = m == neg_inf();
      const float x0 = empty ? 0.f : expf(l0[r] - m);  // exp(-inf) = 0 for empty sources
      const float x1 = empty ? 0.f : expf(l1[r] - m);
      const float sum = warp_sum(x0 + x1);  // >= 1 unless empty: the max term is exp(0)
      w0[r] = empty ? 0.f : x0 / sum;
      w1[r] = empty ? 0.f : x1 / sum;
      if (out_lse != nullptr && lane == 0 && g0 + r < items) {
        out_lse[g0 + r] = empty ? neg_inf() : m + logf(sum);
      }
    }
    // 3. Payload: out = sum over sources of w_s * payload_s in fp32, rounded once (an empty item
    // reads nothing and stores zeros).
    const char* prow = payload + static_cast<u64>(g0) * row_bytes;
    char* orow = reinterpret_cast<char*>(out) + static_cast<u64>(g0) * row_bytes;
    for (int v0 = 0; v0 < nvec; v0 += 32) {
      const int v = v0 + lane;
      float acc[R][E];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int q = 0; q < E; ++q) acc[r][q] = 0.f;
      for (int k0 = 0; k0 < W; k0 += kSrcBatch) {
        uint4 x[R][kSrcBatch];
        float wk[R][kSrcBatch];
        // Issue every load of the batch (every item, every source) before using any of them.
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int k = 0; k < kSrcBatch; ++k) {
            const int s = k0 + k;  // warp-uniform
            const float ws = __shfl_sync(0xffffffffu, s < 32 ? w0[r] : w1[r], s & 31);
            wk[r][k] = s < W ? ws : 0.f;
            x[r][k].x = x[r][k].y = x[r][k].z = x[r][k].w = 0u;
            if (wk[r][k] > 0.f && v < nvec) {
              x[r][k] = ld16(prow + static_cast<u64>(s) * src_stride_bytes +
                             static_cast<u64>(r) * row_bytes + static_cast<u64>(v) * 16);
            }
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int k = 0; k < kSrcBatch; ++k) {
            if (wk[r][k] > 0.f) {
              float f[E];
              unpack16<OUT_T>(x[r][k], f);
#pragma unroll
              for (int q = 0; q < E; ++q) acc[r][q] = fmaf(wk[r][k], f[q], acc[r][q]);
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (g0 + r < items && v < nvec) {
          st16(orow + static_cast<u64>(r) * row_bytes + static_cast<u64>(v) * 16,
               pack16<OUT_T>(acc[r]));  // one rounding
        }
      }
    }
  }
}

// Fingerprint code of the lse_partial dtype (dcpkit/ops/_protocol.py LSE_CODES).
template <typename T> struct lse_code;
template <> struct lse_code<bf16_t> { static constexpr u32 value = 1; };
template <> struct lse_code<fp16_t> { static constexpr u32 value = 2; };
template <> struct lse_code<float> { static constexpr u32 value = 3; };

// The poison pattern over a call's whole result (out [T][H_r][D_v], out_lse [T][H_r] or null),
// by CTAs [0, ncta): 0xFF bytes, NaN in every output dtype.
__device__ __forceinline__ void poison_result(char* out, float* out_lse, int T, int H_r,
                                              u64 row_bytes, u32 cta, u32 ncta) {
  poison_fill16(out, static_cast<long long>(row_bytes), static_cast<u32>(T * H_r),
                static_cast<u32>(row_bytes / 16), cta, ncta);
  if (out_lse != nullptr) {
    for (int i = static_cast<int>(cta * blockDim.x + threadIdx.x); i < T * H_r;
         i += static_cast<int>(ncta * blockDim.x)) {
      out_lse[i] = __int_as_float(-1);  // 0xFFFFFFFF: NaN
    }
  }
}

}  // namespace lse_detail

// One call of LseReduce (dcpkit/ops/lse_reduce.py). Strides are in elements; seq_lens,
// query_start_loc and out_lse may be null. Host guarantees: D_v * sizeof(OUT_T) % 16 == 0,
// 16-byte aligned input rows (out_partial, token and head strides), out contiguous and 16-byte
// aligned, world_size <= kMaxSources, blockDim.x == kThreads. Any grid: the last
// min(grid, P.waiters) CTAs to arrive wait and combine, the others send and exit (NOTE [dcpkit
// epoch signalling], co-residency rule; two CTAs fit on one SM by the launch bounds).
template <typename OUT_T, typename LSE_T>
__global__ void __launch_bounds__(lse_detail::kThreads, 2)
lse_reduce_kernel(DCPKIT_PROTO_PARAMS, const u64* peer_data, u64 slot_bytes, u64 lse_offset,
                  int T_max, const OUT_T* out_partial, long long in_tok_stride,
                  long long in_head_stride, const LSE_T* lse_partial, long long lse_tok_stride,
                  long long lse_head_stride, float lse_scale, const int* seq_lens,
                  const int* query_start_loc, int num_requests, OUT_T* out, float* out_lse,
                  int T, int H, int H_r, int D_v) {
  using namespace lse_detail;
  (void)H;  // H == W * H_r; kept in the signature for readability of the launch
  const Proto P = DCPKIT_PROTO_MAKE();
  const u64 row_bytes = static_cast<u64>(D_v) * sizeof(OUT_T);
  // Poisoned: send nothing, arrive; the elected CTA fills the result (NOTE [dcpkit epoch
  // signalling]).
  const bool dead = __syncthreads_or(aborted(P) ? 1 : 0) != 0;
  const u64 e = call_epoch(P);  // read once: the elected CTA stores e before the kernel ends
  const u32 e32 = static_cast<u32>(e);
  const int slot = static_cast<int>(e & 1ull);
  const int W = P.world;
  const int rank = P.rank;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int nwarps = static_cast<int>(gridDim.x) * kWarps;
  const int nvec = static_cast<int>(row_bytes / 16);
  const u64 slot_off = static_cast<u64>(slot) * slot_bytes;
  const u32 fp = call_fingerprint(P, static_cast<u32>(T), lse_code<LSE_T>::value,
                                  query_start_loc != nullptr, seq_lens != nullptr);

  // 1. Send. Row i -> destination d (ranks start on different destinations), token t, head h.
  // A warp takes kSendRows of its rows (i, i + nwarps, ...) at once: their first payload
  // loads, destination pointers, lse values and masks are all issued before the first store.
  const int rows = dead ? 0 : W * T * H_r;
  for (int i0 = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x >> 5);
       i0 < rows; i0 += nwarps * kSendRows) {
    const char* in_row[kSendRows];
    char* base[kSendRows];
    int t[kSendRows];
    u64 srow[kSendRows];
    float l[kSendRows];
    uint4 r[kSendRows][kSendBatch];
#pragma unroll
    for (int q = 0; q < kSendRows; ++q) {
      const int i = i0 + q * nwarps;
      const int ii = i < rows ? i : i0;  // past the end: a copy of row i0, never stored
      const int d = (rank + 1 + ii % W) % W;
      const int j = ii / W;
      t[q] = j / H_r;
      const int h = j - t[q] * H_r;
      const long long hg = static_cast<long long>(d) * H_r + h;
      in_row[q] = reinterpret_cast<const char*>(
          out_partial + static_cast<long long>(t[q]) * in_tok_stride + hg * in_head_stride);
      // The first loads are issued before the lse is known (the row is valid memory either way).
#pragma unroll
      for (int u = 0; u < kSendBatch; ++u) {
        const int v = lane + u * 32;
        if (v < nvec) r[q][u] = ld16_nc(in_row[q] + static_cast<u64>(v) * 16);
      }
      base[q] = reinterpret_cast<char*>(__ldg(peer_data + d)) + slot_off;
      srow[q] = (static_cast<u64>(rank) * T_max + t[q]) * H_r + h;
      l[q] = to_float(lse_partial[static_cast<long long>(t[q]) * lse_tok_stride +
                                  hg * lse_head_stride]) * lse_scale;
    }
    bool masked[kSendRows];
    rows_masked<kSendRows>(t, query_start_loc, seq_lens, num_requests, masked);
#pragma unroll
    for (int q = 0; q < kSendRows; ++q) {
      if (i0 + q * nwarps >= rows) break;  // warp-uniform
      const float lq = masked[q] ? neg_inf() : sanitize_lse(l[q]);
      if (lq != neg_inf()) {
        char* dst = base[q] + srow[q] * row_bytes;
#pragma unroll
        for (int u = 0; u < kSendBatch; ++u) {
          const int v = lane + u * 32;
          if (v < nvec) st16(dst + static_cast<u64>(v) * 16, r[q][u]);
        }
        // Rows longer than kSendBatch vectors per lane: the rest, kSendBatch vectors at a time.
        for (int v0 = lane + 32 * kSendBatch; v0 < nvec; v0 += 32 * kSendBatch) {
          uint4 x[kSendBatch];
#pragma unroll
          for (int u = 0; u < kSendBatch; ++u) {
            const int v = v0 + u * 32;
            if (v < nvec) x[u] = ld16_nc(in_row[q] + static_cast<u64>(v) * 16);
          }
#pragma unroll
          for (int u = 0; u < kSendBatch; ++u) {
            const int v = v0 + u * 32;
            if (v < nvec) st16(dst + static_cast<u64>(v) * 16, x[u]);
          }
        }
      }
      if (lane == 0) reinterpret_cast<float*>(base[q] + lse_offset)[srow[q]] = lq;
    }
  }

  // 2. Arrive, elect, publish (NOTE [dcpkit epoch signalling], steps 2 and 4).
  bool published;
  const int w = arrive_and_publish<Transport::Unicast>(P, e, slot, fp, P.waiters, dead,
                                                    published);
  if (w < 0) {  // not a waiter: help with the combine if every source is there soon
    if (dead || !try_all_sources(P, slot, e32, fp)) return;
  } else {
    const int nw = static_cast<int>(P.waiters < gridDim.x ? P.waiters : gridDim.x);
    const bool elected = w == nw - 1;
    // 3. The waiters combine the own slot once every source (this rank included) has
    // published. Poisoned, or a wait failed: the elected CTA fills the whole result.
    if ((elected && !published) || (!elected && dead) || !wait_all_sources(P, slot, e32, fp)) {
      if (elected) poison_result(reinterpret_cast<char*>(out), out_lse, T, H_r, row_bytes, 0u, 1u);
      return;
    }
  }
  // The combine, in units of kUnitItems items claimed from the call's work counter.
  const char* own = reinterpret_cast<const char*>(peer_data[rank]) + slot_off;
  const int units = (T * H_r + kUnitItems - 1) / kUnitItems;
  for (int c = static_cast<int>(claim_work(P, slot)); c < units;) {
    const u32 next = claim_issue(P, slot);  // in flight while unit c is combined
    combine_rows<OUT_T>(own, static_cast<u64>(T_max) * H_r * row_bytes,
                        reinterpret_cast<const float*>(own + lse_offset),
                        static_cast<u64>(T_max) * H_r, W, T, H_r, D_v, out, out_lse, c, units);
    c = static_cast<int>(claim_publish(next));
  }
}

// The merge alone, over local contiguous arrays: src_out [W][T][H_r][D_v], src_lse float
// [W][T][H_r] (natural log; NaN / +inf count as -inf), out [T][H_r][D_v], out_lse [T][H_r] or
// null. No protocol: used by the NCCL fallback after its all_to_all (dcpkit.ops.lse_reduce.
// lse_combine).
template <typename OUT_T>
__global__ void __launch_bounds__(lse_detail::kThreads)
lse_combine_kernel(const OUT_T* src_out, const float* src_lse, OUT_T* out, float* out_lse, int W,
                   int T, int H_r, int D_v) {
  using namespace lse_detail;
  const u64 row_bytes = static_cast<u64>(D_v) * sizeof(OUT_T);
  combine_rows<OUT_T>(reinterpret_cast<const char*>(src_out),
                      static_cast<u64>(T) * H_r * row_bytes, src_lse,
                      static_cast<u64>(T) * H_r, W, T, H_r, D_v, out, out_lse,
                      static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
}

}  // namespace dcpkit
