// lse_reduce.cu: the direct all-to-all of partial attention outputs with the log-sum-exp (LSE)
// weighted merge, in one launch per call. Python side: dcpkit/ops/lse_reduce.py. Reference:
// dcpkit/reference.py::lse_reduce_reference.
//
// Every rank r holds out_partial [T, H, D_v] and lse_partial [T, H] (attention of all heads over
// its KV shard). Rank d owns heads [d*H_r, (d+1)*H_r). One kernel per call:
//   1. send     every CTA, warps grid-stride over rows (destination d, token t, local head h),
//               one row per warp at a time (small instance) or kSendRows rows per warp at once
//               (large instance, all their loads before their stores): the row
//               out_partial[t, d*H_r + h] goes (16-byte stores) to slot row [r][t][h] on rank
//               d; then every thread stores the lse of rows (natural log, sanitised, -inf
//               when the row is masked) to the lse slot [r][t][h] of every rank. Padding
//               rows (t >= query_start_loc[S]) send no payload. The own rows (d = r) are not
//               copied unless `out` overlaps the input: the combine reads them from
//               out_partial.
//   2. publish  publish_shares, no election (NOTE [dcpkit share counters] in dcpkit_ptx.cuh):
//               CTA barrier, then every CTA's one fence.acq_rel.sys and the add of its share
//               into counters[r] of every rank (this one last); CTA 0 stores the signal word
//               (the fingerprint) into signals[slot][r] of every rank before its fence.
//   3. combine  the last K CTAs by index (K = min(grid, waiter_ctas)) wait for every source's
//               counter (its own rank's included: it says every CTA of this kernel finished its
//               stores); the last of them stores the new epoch. The other CTAs help if every
//               counter is there within help_budget_ns, else exit.
//               They claim units of kWarps items (t, h) from the call's work counter (the
//               next claim overlapping the unit in hand when there are more units than CTAs):
//               out = sum_s w_s * payload_s in fp32, rounded once; merged lse = m + log(sum).
//               Built with -DDCPKIT_LSE_REG_SOURCES=R, the small instance merges worlds of at
//               most R in registers (combine_rows_regs), with the bits of the warp merge.
// At large T the loads of data read once in the call (the rows for the peers, the slot rows and
// the own input rows of the combine) are marked evict-first in the L2 (ld16_nc_once / ld16_once).
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
constexpr int kSendBatch = 4;                 // 16-byte vectors per lane in flight (one row per warp)
constexpr int kSendRows = 4;                  // rows a warp sends at once (batched send)
constexpr int kSendVec = 2;                   // 16-byte vectors per lane per row and step
constexpr int kVecPerLane = 2;                // 16-byte vectors per lane per merge step
constexpr int kCombineItems = 2;             // items per warp at once in a wide combine
constexpr int kSrcBatch = 4;                  // sources per merge step (loads in flight: 8)

// Worlds of at most this many sources merge in registers (combine_rows_regs); 0, the build
// without -DDCPKIT_LSE_REG_SOURCES: every world takes the warp merge. LseReduce builds with 4 for
// worlds up to 4 (dcpkit/ops/lse_reduce.py, REG_SOURCES).
#ifndef DCPKIT_LSE_REG_SOURCES
#define DCPKIT_LSE_REG_SOURCES 0
#endif
constexpr int kRegSources = DCPKIT_LSE_REG_SOURCES;
static_assert(kRegSources >= 0 && kRegSources <= 8 && (kRegSources & (kRegSources - 1)) == 0,
              "DCPKIT_LSE_REG_SOURCES must be 0, 1, 2, 4 or 8");

// NaN and +inf mean an empty or invalid shard: both become -inf.
__device__ __forceinline__ float sanitize_lse(float l) { return (l < pos_inf()) ? l : neg_inf(); }

// Whether the bytes of a T x H grid of rows (row_bytes each, tok / head strides in bytes, any
// sign) from `a` overlap the n bytes at `b` (conservative: the grid's bounding range).
__device__ __forceinline__ bool extents_overlap(const char* a, long long tok, long long head,
                                                int T, int H, long long row_bytes, const char* b,
                                                long long n) {
  if (T <= 0 || H <= 0 || n <= 0) return false;
  const long long dt = static_cast<long long>(T - 1) * tok, dh = static_cast<long long>(H - 1) * head;
  const char* lo = a + (dt < 0 ? dt : 0) + (dh < 0 ? dh : 0);
  const char* hi = a + (dt > 0 ? dt : 0) + (dh > 0 ? dh : 0) + row_bytes;
  return lo < b + n && b < hi;
}

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

// row_masked(t, query_start_loc, seq_lens, S) and the infinities: kernels/lse_rows.cuh.

#if DCPKIT_LSE_REG_SOURCES
// combine_rows for W <= kRegSources (R) and every source in `payload` (no own_src): the same
// merge without shared memory, ballot or shuffle. Every lane loads the W lse values of its item
// itself (the same addresses in every lane) and derives max, exps, sum and weights in registers.
// The lse loads and the payload loads of the first pass (W sources x kVecPerLane vectors per
// lane) are issued together, before the weights are known: every source has published before
// the combine starts, so every row is there to read; a source whose weight ends up 0 is loaded
// then, but its value is never used (it may be NaN). Later passes load only the sources with
// w > 0.
//
// Bit for bit the warp path. For W <= R that path holds source s's value in lane s < W and the
// identity in every other lane (-inf for the max, 0.f for the sum), then runs the xor butterfly
// over offsets 16, 8, .., 1. An offset >= R adds only identities to lanes [0, R) (x + 0.f == x
// for x >= 0, fmaxf(x, -inf) == x). An offset o < R gives lane i < o the value v[i] op v[i + o]
// of the step before, and lane i + o the same bits (float + and fmaxf are commutative). So every
// lane ends with the tree `v[i] = v[i] op v[i + o]` for i < o, o = R/2 .. 1, which this path
// computes with absent sources as the identities: for R = 4 the sum is (x0 + x2) + (x1 + x3).
// (Lanes may differ in the sign of a zero max, which changes no exp, weight or merged lse.) The
// rest is per source or per element as there: w = x / sum (0 for an absent source), out_lse =
// m + logf(sum), acc = fmaf(w, f, acc) from 0.f over the sources with w > 0 in source order, one
// rounding at the store.
template <typename OUT_T>
__device__ __forceinline__ void combine_rows_regs(const char* payload, u64 src_stride_bytes,
                                                  const float* lse, u64 src_lse_stride, int W,
                                                  int T, int H_r, int D_v, OUT_T* out,
                                                  float* out_lse, int cta, int ncta) {
  constexpr int R = kRegSources;
  constexpr int E = vec_elems<OUT_T>::value;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int wib = static_cast<int>(threadIdx.x >> 5);
  const int nwarps = ncta * kWarps;
  const int items = T * H_r;
  const u64 row_bytes = static_cast<u64>(D_v) * sizeof(OUT_T);
  const int nvec = static_cast<int>(row_bytes / 16);

  for (int item = cta * kWarps + wib; item < items; item += nwarps) {
    char* orow = reinterpret_cast<char*>(out) + static_cast<u64>(item) * row_bytes;
    const char* prow = payload + static_cast<u64>(item) * row_bytes;
    const char* sp[R];
    float l[R];
    uint4 r[R][kVecPerLane];
#pragma unroll
    for (int s = 0; s < R; ++s) {
      l[s] = neg_inf();  // an absent source
      if (s < W) l[s] = ld_cg_f32(lse + static_cast<u64>(s) * src_lse_stride + item);
    }
#pragma unroll
    for (int s = 0; s < R; ++s) {
      sp[s] = prow + static_cast<u64>(s) * src_stride_bytes;
#pragma unroll
      for (int c = 0; c < kVecPerLane; ++c) {
        const int v = lane + c * 32;
        r[s][c].x = r[s][c].y = r[s][c].z = r[s][c].w = 0u;
        if (s < W && v < nvec) r[s][c] = ld16(sp[s] + static_cast<u64>(v) * 16);
      }
    }
    float t[R];
#pragma unroll
    for (int s = 0; s < R; ++s) t[s] = l[s] = sanitize_lse(l[s]);
#pragma unroll
    for (int o = R / 2; o > 0; o >>= 1)
#pragma unroll
      for (int i = 0; i < o; ++i) t[i] = fmaxf(t[i], t[i + o]);
    const float m = t[0];
    // Every lane's loads of the item before any lane's store of it, as the shuffles order them
    // in the warp path (lse_combine's out / out_lse may be its input).
    __syncwarp();
    // Every source empty (m = -inf): weights 0, so the passes below store zeros and read
    // nothing more; merged lse -inf.
    float w[R];
    float sum = 0.f;
    if (m != neg_inf()) {
      float x[R];
#pragma unroll
      for (int s = 0; s < R; ++s) {
        t[s] = x[s] = s < W ? expf(l[s] - m) : 0.f;  // exp(-inf) = 0 for empty sources
      }
#pragma unroll
      for (int o = R / 2; o > 0; o >>= 1)
#pragma unroll
        for (int i = 0; i < o; ++i) t[i] = t[i] + t[i + o];
      sum = t[0];  // >= 1: the max term is exp(0)
#pragma unroll
      for (int s = 0; s < R; ++s) w[s] = x[s] / sum;  // 0 for an absent source
    } else {
#pragma unroll
      for (int s = 0; s < R; ++s) w[s] = 0.f;
    }
    if (out_lse != nullptr && lane == 0) out_lse[item] = m == neg_inf() ? m : m + logf(sum);

    for (int v0 = lane;;) {
      float acc[kVecPerLane][E];
#pragma unroll
      for (int c = 0; c < kVecPerLane; ++c)
#pragma unroll
        for (int k = 0; k < E; ++k) acc[c][k] = 0.f;
#pragma unroll
      for (int s = 0; s < R; ++s) {
        if (w[s] > 0.f) {
#pragma unroll
          for (int c = 0; c < kVecPerLane; ++c) {
            float f[E];
            unpack16<OUT_T>(r[s][c], f);
#pragma unroll
            for (int q = 0; q < E; ++q) acc[c][q] = fmaf(w[s], f[q], acc[c][q]);
          }
        }
      }
#pragma unroll
      for (int c = 0; c < kVecPerLane; ++c) {
        const int v = v0 + c * 32;
        if (v < nvec) st16(orow + static_cast<u64>(v) * 16, pack16<OUT_T>(acc[c]));  // one rounding
      }
      v0 += 32 * kVecPerLane;
      if (v0 >= nvec) break;
#pragma unroll
      for (int s = 0; s < R; ++s)
#pragma unroll
        for (int c = 0; c < kVecPerLane; ++c) {
          const int v = v0 + c * 32;
          if (w[s] > 0.f && v < nvec) r[s][c] = ld16(sp[s] + static_cast<u64>(v) * 16);
        }
    }
  }
}
#endif

// The merge, shared by both kernels. The warps of CTAs [0, ncta) (this one is `cta`) stride over
// items (t, h) in [0, T*H_r).
//   payload : source 0, item 0 of [W][T_cap][H_r][D_v] OUT_T (src_stride_bytes between sources)
//   lse     : source 0, item 0 of [W][T_cap][H_r] float (src_lse_stride elements between sources)
//   out     : [T][H_r][D_v] contiguous, 16-byte aligned rows; out_lse: [T][H_r] or null.
// Source lse values are sanitised again here (the local kernel gets them straight from NCCL).
// A source with weight 0 is never used: its payload may hold anything, NaN included. The warp
// merge never reads it; combine_rows_regs loads the first pass of every source's row before the
// weights are known, so every source's row must be mapped memory (the slot and the local
// merge's src_out are).
// Source `own_src` (-1: none) is not read from `payload` but from the caller's input: item
// (t, h) at own_rows + t * own_tok_bytes + h * own_head_bytes (the own heads of out_partial).
// Built with DCPKIT_LSE_REG_SOURCES = R > 0, a call with reg_merge, at most R sources and no
// own_src takes combine_rows_regs instead (the same bits, merged in registers).
template <typename OUT_T>
__device__ __forceinline__ void combine_rows(const char* payload, u64 src_stride_bytes,
                                             const float* lse, u64 src_lse_stride, int W, int T,
                                             int H_r, int D_v, OUT_T* out, float* out_lse,
                                             int cta, int ncta, int own_src = -1,
                                             const char* own_rows = nullptr,
                                             long long own_tok_bytes = 0,
                                             long long own_head_bytes = 0,
                                             bool reg_merge = true) {
  constexpr int E = vec_elems<OUT_T>::value;
  __shared__ float s_p[kWarps][kMaxSources];    // lse, then exp(l - m), per source
  __shared__ float s_w[kWarps][kMaxSources];    // weights of the sources that are read
  __shared__ int s_src[kWarps][kMaxSources];    // ... and their source index
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int wib = static_cast<int>(threadIdx.x >> 5);
  const int nwarps = ncta * kWarps;
  const int items = T * H_r;
  const u64 row_bytes = static_cast<u64>(D_v) * sizeof(OUT_T);
  const int nvec = static_cast<int>(row_bytes / 16);
  float* p = s_p[wib];
  float* wv = s_w[wib];
  int* src = s_src[wib];
#if DCPKIT_LSE_REG_SOURCES
  if (reg_merge && own_src < 0 && W <= kRegSources) {
    combine_rows_regs<OUT_T>(payload, src_stride_bytes, lse, src_lse_stride, W, T, H_r, D_v, out,
                             out_lse, cta, ncta);
    return;
  }
#endif

  for (int item = cta * kWarps + wib; item < items; item += nwarps) {
    char* orow = reinterpret_cast<char*>(out) + static_cast<u64>(item) * row_bytes;
    // Max over sources (lane s holds sources s, s + 32, ...).
    float m = neg_inf();
    for (int b = 0; b < W; b += 32) {
      const int s = b + lane;
      if (s < W) {
        const float l = sanitize_lse(ld_cg_f32(lse + static_cast<u64>(s) * src_lse_stride + item));
        p[s] = l;
        m = fmaxf(m, l);
      }
    }
    m = warp_max(m);
    if (m == neg_inf()) {  // every source empty: output 0, merged lse -inf, nothing read
      uint4 z;
      z.x = z.y = z.z = z.w = 0u;
      for (int v = lane; v < nvec; v += 32) st16(orow + static_cast<u64>(v) * 16, z);
      if (out_lse != nullptr && lane == 0) out_lse[item] = neg_inf();
      __syncwarp();
      continue;
    }
    float sum = 0.f;
    for (int b = 0; b < W; b += 32) {
      const int s = b + lane;
      if (s < W) {
        const float x = expf(p[s] - m);  // exp(-inf) = 0 for empty sources
        p[s] = x;
        sum += x;
      }
    }
    sum = warp_sum(sum);  // >= 1: the max term is exp(0)
    // Weights; compact the sources with w > 0 (in source order) into wv / src.
    int n = 0;
    for (int b = 0; b < W; b += 32) {
      const int s = b + lane;
      const float w = (s < W) ? p[s] / sum : 0.f;
      const bool keep = w > 0.f;
      const u32 bal = __ballot_sync(0xffffffffu, keep);
      if (keep) {
        const int pos = n + __popc(bal & ((1u << lane) - 1u));
        wv[pos] = w;
        src[pos] = s;
      }
      n += __popc(bal);
    }
    __syncwarp();
    if (out_lse != nullptr && lane == 0) out_lse[item] = m + logf(sum);

    const char* prow = payload + static_cast<u64>(item) * row_bytes;
    const char* orow_in = nullptr;  // the own source's row in the input
    if (own_src >= 0) {
      const int t = item / H_r;
      orow_in = own_rows + t * own_tok_bytes + (item - t * H_r) * own_head_bytes;
    }
    for (int v0 = lane; v0 < nvec; v0 += 32 * kVecPerLane) {
      float acc[kVecPerLane][E];
#pragma unroll
      for (int c = 0; c < kVecPerLane; ++c)
#pragma unroll
        for (int k = 0; k < E; ++k) acc[c][k] = 0.f;
      for (int k0 = 0; k0 < n; k0 += kSrcBatch) {
        uint4 r[kSrcBatch][kVecPerLane];
        // Issue every load of the batch before using any of them.
#pragma unroll
        for (int k = 0; k < kSrcBatch; ++k) {
          const bool ks = k0 + k < n;
          const int sk = ks ? src[k0 + k] : 0;
          const char* sp =
              sk == own_src ? orow_in : prow + static_cast<u64>(sk) * src_stride_bytes;
#pragma unroll
          for (int c = 0; c < kVecPerLane; ++c) {
            const int v = v0 + c * 32;
            r[k][c].x = r[k][c].y = r[k][c].z = r[k][c].w = 0u;
            if (ks && v < nvec) r[k][c] = ld16(sp + static_cast<u64>(v) * 16);
          }
        }
#pragma unroll
        for (int k = 0; k < kSrcBatch; ++k) {
          if (k0 + k < n) {
            const float w = wv[k0 + k];
#pragma unroll
            for (int c = 0; c < kVecPerLane; ++c) {
              float f[E];
              unpack16<OUT_T>(r[k][c], f);
#pragma unroll
              for (int q = 0; q < E; ++q) acc[c][q] = fmaf(w, f[q], acc[c][q]);
            }
          }
        }
      }
#pragma unroll
      for (int c = 0; c < kVecPerLane; ++c) {
        const int v = v0 + c * 32;
        if (v < nvec) st16(orow + static_cast<u64>(v) * 16, pack16<OUT_T>(acc[c]));  // one rounding
      }
    }
    __syncwarp();  // wv / src are rewritten by the next item
  }
}

// The merge of kItems items per warp at once (large T): unit `unit` covers items
// [unit * kWarps * kItems, (unit + 1) * kWarps * kItems); warp w of the CTA takes items
// unit * kWarps * kItems + r * kWarps + w, r < kItems. Same arithmetic per item as combine_rows
// (max, exp, sum, weight = x / sum, fma over the read sources in source order, one rounding; a
// zero-weight source is never read), but the lse loads of all kItems items are issued together,
// and every payload batch holds kSrcBatch / kItems sources of each item, so a lane keeps
// kSrcBatch x kVecPerLane loads in flight even when the world is 2.
template <typename OUT_T, int kItems>
__device__ __forceinline__ void combine_unit(const char* payload, u64 src_stride_bytes,
                                             const float* lse, u64 src_lse_stride, int W, int T,
                                             int H_r, int D_v, OUT_T* out, float* out_lse,
                                             int unit, int own_src, const char* own_rows,
                                             long long own_tok_bytes, long long own_head_bytes) {
  constexpr int E = vec_elems<OUT_T>::value;
  static_assert(kMaxSources <= 64, "two lse values per lane");
  __shared__ float s_w[kWarps][kItems][kMaxSources];  // weights of the sources that are read
  __shared__ int s_src[kWarps][kItems][kMaxSources];  // ... and their source index
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int wib = static_cast<int>(threadIdx.x >> 5);
  const int items = T * H_r;
  const u64 row_bytes = static_cast<u64>(D_v) * sizeof(OUT_T);
  const int nvec = static_cast<int>(row_bytes / 16);

  int item[kItems];
  float lv[kItems][2];
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    item[r] = (unit * kItems + r) * kWarps + wib;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int s = b * 32 + lane;
      lv[r][b] = (item[r] < items && s < W)
                     ? sanitize_lse(ld_cg_f32(lse + static_cast<u64>(s) * src_lse_stride + item[r]))
                     : neg_inf();
    }
  }
  constexpr int kPer = kSrcBatch / kItems;  // sources of each item per batch
  static_assert(kPer >= 1, "kSrcBatch >= kItems");
  int n[kItems];  // sources read per item
  int n_max = 0;
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    n[r] = 0;
    if (item[r] >= items) continue;  // warp-uniform
    char* orow = reinterpret_cast<char*>(out) + static_cast<u64>(item[r]) * row_bytes;
    const float m = warp_max(fmaxf(lv[r][0], lv[r][1]));
    if (m == neg_inf()) {  // every source empty: output 0, merged lse -inf, nothing read
      uint4 z;
      z.x = z.y = z.z = z.w = 0u;
      for (int v = lane; v < nvec; v += 32) st16(orow + static_cast<u64>(v) * 16, z);
      if (out_lse != nullptr && lane == 0) out_lse[item[r]] = neg_inf();
      continue;
    }
    const float x0 = expf(lv[r][0] - m), x1 = expf(lv[r][1] - m);  // exp(-inf) = 0
    const float sum = warp_sum(x0 + x1);  // >= 1: the max term is exp(0)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int s = b * 32 + lane;
      const float w = (s < W) ? (b == 0 ? x0 : x1) / sum : 0.f;
      const bool keep = w > 0.f;
      const u32 bal = __ballot_sync(0xffffffffu, keep);
      if (keep) {
        const int pos = n[r] + __popc(bal & ((1u << lane) - 1u));
        s_w[wib][r][pos] = w;
        s_src[wib][r][pos] = s;
      }
      n[r] += __popc(bal);
    }
    if (out_lse != nullptr && lane == 0) out_lse[item[r]] = m + logf(sum);
    n_max = n[r] > n_max ? n[r] : n_max;
  }
  __syncwarp();
  if (n_max == 0) return;

  // Row addresses of every item (source s at prow + s * src_stride; the own source in the input).
  const char* prow[kItems];
  const char* orow_in[kItems];
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    const int it = item[r] < items ? item[r] : 0;
    prow[r] = payload + static_cast<u64>(it) * row_bytes;
    orow_in[r] = nullptr;
    if (own_src >= 0) {
      const int t = it / H_r;
      orow_in[r] = own_rows + t * own_tok_bytes + (it - t * H_r) * own_head_bytes;
    }
  }
  const u64 pol = l2_evict_first();  // every row is read once in the call (input or slot)
  for (int v0 = lane; v0 < nvec; v0 += 32 * kVecPerLane) {
    float acc[kItems][kVecPerLane][E];
#pragma unroll
    for (int r = 0; r < kItems; ++r)
#pragma unroll
      for (int c = 0; c < kVecPerLane; ++c)
#pragma unroll
        for (int k = 0; k < E; ++k) acc[r][c][k] = 0.f;
    // Batches of kPer sources of every item: slot (r, q) is source k0 + q of item r.
    for (int k0 = 0; k0 < n_max; k0 += kPer) {
      uint4 x[kItems][kPer][kVecPerLane];
      // Issue every load of the batch before using any of them.
#pragma unroll
      for (int r = 0; r < kItems; ++r)
#pragma unroll
        for (int q = 0; q < kPer; ++q) {
          const bool ks = k0 + q < n[r];
          const int sk = ks ? s_src[wib][r][k0 + q] : 0;
          const char* sp =
              sk == own_src ? orow_in[r] : prow[r] + static_cast<u64>(sk) * src_stride_bytes;
#pragma unroll
          for (int c = 0; c < kVecPerLane; ++c) {
            const int v = v0 + c * 32;
            x[r][q][c].x = x[r][q][c].y = x[r][q][c].z = x[r][q][c].w = 0u;
            if (ks && v < nvec) x[r][q][c] = ld16_once(sp + static_cast<u64>(v) * 16, pol);
          }
        }
#pragma unroll
      for (int r = 0; r < kItems; ++r)
#pragma unroll
        for (int q = 0; q < kPer; ++q) {
          if (k0 + q < n[r]) {
            const float w = s_w[wib][r][k0 + q];
#pragma unroll
            for (int c = 0; c < kVecPerLane; ++c) {
              float f[E];
              unpack16<OUT_T>(x[r][q][c], f);
#pragma unroll
              for (int k = 0; k < E; ++k) acc[r][c][k] = fmaf(w, f[k], acc[r][c][k]);
            }
          }
        }
    }
#pragma unroll
    for (int r = 0; r < kItems; ++r) {
      if (n[r] == 0) continue;  // past the end or every source empty (zeros written above)
      char* orow = reinterpret_cast<char*>(out) + static_cast<u64>(item[r]) * row_bytes;
#pragma unroll
      for (int c = 0; c < kVecPerLane; ++c) {
        const int v = v0 + c * 32;
        if (v < nvec) st16(orow + static_cast<u64>(v) * 16, pack16<OUT_T>(acc[r][c]));
      }
    }
  }
  __syncwarp();  // s_w / s_src are rewritten by the next unit
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

// Unit `c` of `units` of combine_rows (its items c * kWarps + warp, stepping units * kWarps)
// filled with the poison pattern by this CTA: what a waiter that owned the unit and whose wait
// failed leaves instead of stale rows.
__device__ __forceinline__ void poison_unit(char* out, float* out_lse, int T, int H_r,
                                            u64 row_bytes, int c, int units) {
  const uint4 ff = make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int nvec = static_cast<int>(row_bytes / 16);
  for (int item = c * kWarps + static_cast<int>(threadIdx.x >> 5); item < T * H_r;
       item += units * kWarps) {
    char* orow = out + static_cast<u64>(item) * row_bytes;
    for (int v = lane; v < nvec; v += 32) st16(orow + static_cast<u64>(v) * 16, ff);
    if (out_lse != nullptr && lane == 0) out_lse[item] = __int_as_float(-1);
  }
}

}  // namespace lse_detail

// One call of LseReduce (dcpkit/ops/lse_reduce.py). Strides are in elements; seq_lens,
// query_start_loc and out_lse may be null. Host guarantees: D_v * sizeof(OUT_T) % 16 == 0,
// 16-byte aligned input rows (out_partial, token and head strides), out contiguous and 16-byte
// aligned, world_size <= kMaxSources, blockDim.x == kThreads. Any grid: the last
// min(grid, P.waiters) CTAs by index wait and combine, the others send and exit (NOTE [dcpkit
// epoch signalling], co-residency rule; two CTAs fit on one SM by the launch bounds).
template <typename OUT_T, typename LSE_T, bool kLarge>
__global__ void __launch_bounds__(lse_detail::kThreads, 2)
lse_reduce_kernel(DCPKIT_PROTO_PARAMS, const u64* peer_data, u64 slot_bytes, u64 lse_offset,
                  int T_max, const OUT_T* out_partial, long long in_tok_stride,
                  long long in_head_stride, const LSE_T* lse_partial, long long lse_tok_stride,
                  long long lse_head_stride, float lse_scale, const int* seq_lens,
                  const int* query_start_loc, int num_requests, OUT_T* out, float* out_lse,
                  int T, int H, int H_r, int D_v) {
  using namespace lse_detail;
  DCPKIT_MARK_START();
  const Proto P = DCPKIT_PROTO_MAKE();
  const u64 row_bytes = static_cast<u64>(D_v) * sizeof(OUT_T);
  // Poisoned: send nothing, publish a skipped share; the elected CTA fills the result (NOTE
  // [dcpkit share counters]).
  // Both control loads in flight at once, then the poison check's barrier.
  const bool abort_seen = aborted(P);
  const u64 e = call_epoch(P);  // read once: the elected CTA stores e before the kernel ends
  const bool dead = __syncthreads_or(abort_seen ? 1 : 0) != 0;
  DCPKIT_MARK_ENTRY(e);
  DCPKIT_MARK(e, 1u);
  const int slot = static_cast<int>(e & 1ull);
  const int W = P.world;
  const int rank = P.rank;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int nwarps = static_cast<int>(gridDim.x) * kWarps;
  const int nvec = static_cast<int>(row_bytes / 16);
  const u64 slot_off = static_cast<u64>(slot) * slot_bytes;
  const u32 fp = call_fingerprint(P, static_cast<u32>(T), lse_code<LSE_T>::value,
                                  query_start_loc != nullptr, seq_lens != nullptr);

  // 1. Send. Two ways, by size:
  //   * the small instance (the host takes it below large_rows_per_warp rows per warp,
  //     dcpkit/ops/_lse_checks.py): each warp sends one row at a time to its destination, this
  //     rank included, with its lse (fewest dependent rounds: the batched send measured 0.6-1.1
  //     us slower at T=1; all the loads of up to kSendRows rows before their stores measured
  //     0.2-0.6 us slower at T <= 4 and level at T=8, docs/performance.md);
  //   * the large instance, at least kSendRows rows per warp: the own rows stay in the input,
  //     the combine reads them there (no copy into the own slot), unless `out` or `out_lse`
  //     overlaps the input (an in-place call); the rows for the peers go kSendRows per warp at
  //     once, the lse values one per thread (measured 9 % faster at T=32 and 14-22 % at T=128).
  const char* in_bytes = reinterpret_cast<const char*>(out_partial);
  const long long isz = static_cast<long long>(sizeof(OUT_T));
  // Both outputs are written while the combine still reads the input: either one overlapping
  // it takes the copying path.
  const bool own_in =
      kLarge && W * T * H_r >= kSendRows * nwarps &&
      !extents_overlap(in_bytes, in_tok_stride * isz, in_head_stride * isz, T, H,
                       static_cast<long long>(row_bytes), reinterpret_cast<const char*>(out),
                       static_cast<long long>(T) * H_r * row_bytes) &&
      !extents_overlap(in_bytes, in_tok_stride * isz, in_head_stride * isz, T, H,
                       static_cast<long long>(row_bytes), reinterpret_cast<const char*>(out_lse),
                       out_lse != nullptr ? static_cast<long long>(T) * H_r * 4 : 0);
  if (!own_in) {
    // Row i -> destination d (ranks start on different destinations), token t, head h. A row
    // whose lse is -inf sends no payload.
    const int rows = dead ? 0 : W * T * H_r;
    for (int i = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x >> 5);
         i < rows; i += nwarps) {
      const int d = (rank + 1 + i % W) % W;
      const int j = i / W;
      const int t = j / H_r;
      const int h = j - t * H_r;
      const long long hg = static_cast<long long>(d) * H_r + h;
      const char* in_row = reinterpret_cast<const char*>(
          out_partial + static_cast<long long>(t) * in_tok_stride + hg * in_head_stride);
      // The first loads are issued before the lse is known (the row is valid memory either way).
      uint4 r[kSendBatch];
#pragma unroll
      for (int u = 0; u < kSendBatch; ++u) {
        const int v = lane + u * 32;
        if (v < nvec) r[u] = ld16_nc(in_row + static_cast<u64>(v) * 16);
      }
      float l = to_float(lse_partial[static_cast<long long>(t) * lse_tok_stride +
                                     hg * lse_head_stride]) * lse_scale;
      l = sanitize_lse(l);
      if (row_masked(t, query_start_loc, seq_lens, num_requests)) l = neg_inf();
      char* base = reinterpret_cast<char*>(peer_data[d]) + slot_off;
      const u64 srow = (static_cast<u64>(rank) * T_max + t) * H_r + h;
      if (l != neg_inf()) {
        char* dst = base + srow * row_bytes;
        for (int v0 = lane;;) {
#pragma unroll
          for (int u = 0; u < kSendBatch; ++u) {
            const int v = v0 + u * 32;
            if (v < nvec) st16(dst + static_cast<u64>(v) * 16, r[u]);
          }
          v0 += 32 * kSendBatch;
          if (v0 >= nvec) break;
#pragma unroll
          for (int u = 0; u < kSendBatch; ++u) {
            const int v = v0 + u * 32;
            if (v < nvec) r[u] = ld16_nc(in_row + static_cast<u64>(v) * 16);
          }
        }
      }
      if (lane == 0) reinterpret_cast<float*>(base + lse_offset)[srow] = l;
    }
  } else {
    // The lse of every row (natural log, sanitised, -inf when masked), this rank's included, one
    // row per thread: row i of world * T * H_r -> destination d = i / (T * H_r), so the stores of
    // consecutive threads are contiguous. Each thread's first lse load is issued here, in flight
    // with the payload of 1a.
    const int lrows = dead ? 0 : W * T * H_r;
    const int per_dst = T * H_r;
    const int lse_first = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    const int lse_step = static_cast<int>(gridDim.x * blockDim.x);
    auto lse_index = [&](int i) {
      const int d = i / per_dst;
      const int j = i - d * per_dst;
      const int t = j / H_r;
      return static_cast<long long>(t) * lse_tok_stride +
             (static_cast<long long>(d) * H_r + (j - t * H_r)) * lse_head_stride;
    };
    LSE_T lse0{};
    if (lse_first < lrows) lse0 = lse_partial[lse_index(lse_first)];
    // 1a. Payload. Row i of the (world - 1) * T * H_r rows for the peers -> destination
    // d = (rank + 1 + i % (world - 1)) % world (ranks start on different destinations), token
    // t, head h. A warp moves kSendRows rows at once (kSendVec vectors per lane each, all loads
    // before the stores). Padding rows (t >= query_start_loc[num_requests]) move nothing: no
    // rank reads them.
    const int nd = W - 1;
    const int prows = dead ? 0 : nd * T * H_r;
    const int t_end = query_start_loc != nullptr ? __ldg(query_start_loc + num_requests) : T;
    const u64 pol = l2_evict_first();  // the rows for the peers are read once in the call
    for (int i0 = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x >> 5);
         i0 < prows; i0 += nwarps * kSendRows) {
      const char* from[kSendRows];
      char* to[kSendRows];
#pragma unroll
      for (int r = 0; r < kSendRows; ++r) {
        const int i = i0 + r * nwarps;
        from[r] = nullptr;
        to[r] = nullptr;
        if (i < prows) {
          const int j = i / nd;
          const int dj = i - j * nd;
          const int d = (rank + 1 + dj) % W;
          const int t = j / H_r;
          const int h = j - t * H_r;
          if (t < t_end) {
            from[r] = in_bytes + (static_cast<long long>(t) * in_tok_stride +
                                  (static_cast<long long>(d) * H_r + h) * in_head_stride) * isz;
            to[r] = reinterpret_cast<char*>(peer_data[d]) + slot_off +
                    ((static_cast<u64>(rank) * T_max + t) * H_r + h) * row_bytes;
          }
        }
      }
      // Every lane runs the same passes (v < nvec masks the tail), so the warp stays converged
      // and the __syncwarp() is legal. It keeps the loads of a pass before its stores: without it
      // ptxas, at this kernel's register cap, moved each row's loads after the previous row's
      // stores, and the warp, issuing in order, paid one round trip per row instead of one per
      // pass.
      for (int v0 = 0; v0 < nvec; v0 += 32 * kSendVec) {
        uint4 x[kSendRows][kSendVec];
#pragma unroll
        for (int r = 0; r < kSendRows; ++r)
#pragma unroll
          for (int c = 0; c < kSendVec; ++c) {
            const int v = v0 + lane + c * 32;
            if (to[r] != nullptr && v < nvec) {
              x[r][c] = ld16_nc_once(from[r] + static_cast<u64>(v) * 16, pol);
            }
          }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < kSendRows; ++r)
#pragma unroll
          for (int c = 0; c < kSendVec; ++c) {
            const int v = v0 + lane + c * 32;
            if (to[r] != nullptr && v < nvec) st16(to[r] + static_cast<u64>(v) * 16, x[r][c]);
          }
      }
    }
    // 1b. The lse rows, stored after the payload (the first one was loaded before it).
    for (int i = lse_first; i < lrows; i += lse_step) {
      const int d = i / per_dst;
      const int j = i - d * per_dst;
      const int t = j / H_r;
      const int h = j - t * H_r;
      float l = to_float(i == lse_first ? lse0 : lse_partial[lse_index(i)]) * lse_scale;
      l = sanitize_lse(l);
      if (row_masked(t, query_start_loc, seq_lens, num_requests)) l = neg_inf();
      char* base = reinterpret_cast<char*>(peer_data[d]) + slot_off;
      reinterpret_cast<float*>(base + lse_offset)[(static_cast<u64>(rank) * T_max + t) * H_r + h] = l;
    }
  }

  // 2. Publish by shares, no election (NOTE [dcpkit share counters] in dcpkit_ptx.cuh).
  DCPKIT_MARK(e, 2u);
  publish_shares<Transport::Unicast>(P, e, slot, fp, dead);
  const int w = share_waiter(P.waiters);
  DCPKIT_MARK(e, 3u);
  DCPKIT_MARK_ROLE(e, w < 0 ? 0ull : static_cast<u64>(w) + 1ull);
  // Units of the combine: kWarps items each, or kWarps * kCombineItems when every CTA has at
  // least two such units (`wide`).
  const bool wide = kLarge && T * H_r >= 2 * kCombineItems * kWarps * static_cast<int>(gridDim.x);
  const int per_unit = wide ? kWarps * kCombineItems : kWarps;
  const int units = (T * H_r + per_unit - 1) / per_unit;
  const int nw = static_cast<int>(P.waiters < gridDim.x ? P.waiters : gridDim.x);
  // No more units than waiters (small T, the small instance): waiter w combines unit w, no
  // claims and no helpers (kernel-uniform).
  const bool owned = !kLarge && units <= nw;
  if (w < 0) {  // not a waiter: help with the combine if every source is there soon
    if (owned || dead || !try_all_shares(P, slot, e, fp, static_cast<u32>(units))) {
      DCPKIT_MARK(e, 5u);
      return;
    }
  } else {
    const bool elected = w == nw - 1;
    // 3. The waiters combine the own slot once every source (this rank included: its counter
    // says every CTA of this kernel finished its stores and read the epoch) has published; the
    // elected CTA stores the new epoch (waiter_shares: after a failed wait too, once every CTA
    // of this kernel has published, so that none still reads the input an in-place call's
    // poison overwrites). Poisoned, a CTA of this rank that stored nothing, or a wait failed:
    // the elected CTA fills the whole result, and a waiter that owns a unit fills that one (no
    // unit is left stale).
    if (!waiter_shares(P, slot, e, fp, dead, elected)) {
      if (elected) poison_result(reinterpret_cast<char*>(out), out_lse, T, H_r, row_bytes, 0u, 1u);
      if (owned && !elected && w < units) {
        poison_unit(reinterpret_cast<char*>(out), out_lse, T, H_r, row_bytes, w, units);
      }
      DCPKIT_MARK(e, 5u);
      return;
    }
  }
  DCPKIT_MARK(e, 4u);
  // The combine, in units claimed from the call's work counter: kWarps items per unit, or
  // kWarps * kCombineItems at large T (every CTA has at least two such units to merge).
  const char* own = reinterpret_cast<const char*>(peer_data[rank]) + slot_off;
  const u64 src_stride = static_cast<u64>(T_max) * H_r * row_bytes;
  const float* ls = reinterpret_cast<const float*>(own + lse_offset);
  const u64 lse_stride = static_cast<u64>(T_max) * H_r;
  const int own_src = own_in ? rank : -1;  // read from the input, not the own slot
  const char* own_rows = in_bytes + static_cast<long long>(rank) * H_r * in_head_stride * isz;
  const long long own_tok = in_tok_stride * isz, own_head = in_head_stride * isz;
  if (wide) {
    for (int c = static_cast<int>(claim_work(P, slot)); c < units;) {
      const u32 next = claim_issue(P, slot);
      combine_unit<OUT_T, kCombineItems>(own, src_stride, ls, lse_stride, W, T, H_r, D_v, out,
                                         out_lse, c, own_src, own_rows, own_tok, own_head);
      c = static_cast<int>(claim_publish(next));
    }
  } else {
    // One loop, one copy of combine_rows (three copies made the small instance 97 KB of SASS,
    // one makes it 50 KB: T=1 in a graph measured 0.1-0.3 us faster). The register merge of a
    // DCPKIT_LSE_REG_SOURCES build only in the small instance: in the large one, at the 128
    // registers of its launch bounds, it made ptxas spill 8-24 bytes (its own_src calls would
    // take the warp merge anyway). Three ways to walk the units:
    //   * no more units than waiters (`owned`, small T): waiter w merges unit w, no claims;
    //   * several units per CTA: the next claim is in flight while the unit in hand is merged
    //     (claim_issue / claim_publish; measured 4-5 % faster at T=128);
    //   * about one unit per CTA: the plain claim, which measured about 1 us faster at T=8
    //     than the overlapped one.
    const bool overlap = !owned && units > static_cast<int>(gridDim.x);
    int c = owned ? (w < units ? w : units) : static_cast<int>(claim_work(P, slot));
    while (c < units) {
      const u32 next = overlap ? claim_issue(P, slot) : 0u;
      combine_rows<OUT_T>(own, src_stride, ls, lse_stride, W, T, H_r, D_v, out, out_lse, c, units,
                          own_src, own_rows, own_tok, own_head, !kLarge);
      if (owned) break;
      c = static_cast<int>(overlap ? claim_publish(next) : claim_work(P, slot));
    }
  }
  DCPKIT_MARK(e, 5u);
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
