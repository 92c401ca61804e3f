// gather.cuh: the device code q_gather and kv_gather share. Both ops are "every rank pushes one
// 2-D block of 16-byte vectors into the same place of every rank's slot"; kv_gather is the case
// of one row. See NOTE [dcpkit epoch signalling] in dcpkit_ptx.cuh for the protocol and
// NOTE [dcpkit gather slots] below for the slot ring.
//
// NOTE [dcpkit gather slots]
// --------------------------
// The gathers return a view of the slot itself (zero copy), consumed by the caller's later
// kernels, i.e. AFTER the gather kernel retired. The two-slot argument of NOTE [dcpkit epoch
// signalling] covers reads inside the call only: a peer may push into slot p again at its call
// n + 2 as soon as it saw this rank's n + 1 signal, which this rank publishes inside its call
// n + 1 -- so a view of call n read after call n + 1 was issued would race with the peers' call
// n + 2. The gathers therefore keep THREE data slots per ubatch (data slot = epoch % 3; the
// signals keep their two slots, epoch & 1). Call n's data slot is written again only by calls
// n + 3; a peer's call n + 3 starts after its call n + 2 saw this rank's n + 2 signal, which this
// rank publishes only inside its call n + 2, after everything issued before it on its stream.
// Hence the rule of the docstrings: a view returned by call n stays valid while it is consumed on
// the same stream before call n + 2 of the same ubatch is issued. The 64-bit epoch never wraps,
// so epoch % 3 needs no care at the 32-bit wrap of the signals.
//
// NOTE [dcpkit zero-copy graph outputs]
// -------------------------------------
// A push call captured without out= (the view form; dcpkit/ops/_gather.py) returns a graph
// output buffer of its own, which lies in the symmetric region: the peers store their blocks
// straight into it and nothing is copied out. The host marks such a call by setting bit 0 of
// `out` (the buffer is 256-byte aligned). A graph replays the call into the same buffer, and the
// caller reads the buffer between replays, so a peer may store into it for call e only once the
// caller's work before call e is done. Credits say so:
//   * CTA 0 of every unicast push kernel stores, when it starts, the credit word
//     (units << 32) | (e & 0xFFFFFFFF) into credits[rank] of every peer, where units is the
//     offset of the call's graph output buffer from the ubatch's data slot 0 in 256-byte units,
//     or 0 when the result goes to a slot or to out=. Starting is enough: the kernels before it
//     on the stream have finished, their reads of the buffer included (with programmatic launch
//     the credit follows the wait for them: NOTE [dcpkit programmatic launch]).
//   * The CTAs of a zero-copy call wait, before their stores, until credits[s] holds epoch e for
//     every peer s, and store into the buffer the credit names (units 0: into the peer's data
//     slot, as a slot call expects; the fingerprint carries the mode, DCPKIT_FP_ZC_SHIFT, so both
//     ranks then report a mismatch instead of reading a result that is not there).
//   * The equality test is exact: when this rank waits in call e, the peer has started call e - 1
//     (this rank's call e - 1 waited for its signal) and not call e + 1 (that needs this rank's
//     signal of call e, which follows these stores).
// The receiver names the destination, so ranks never have to agree on which buffer a call uses.
// A rank whose workspace is poisoned still posts its credit (before its poison check), so a live
// peer may store into its buffer while its elected CTA fills the buffer with the poison pattern,
// as with the data slots; that rank's host raises at its next call either way.
// Every CTA of such a call waits (for the credits), so the host caps its grid at half the SM
// share: see the co-residency rule in NOTE [dcpkit epoch signalling].
//
// NOTE [dcpkit early payload loads]
// ---------------------------------
// A call reads two control words before its first payload store: its workspace's abort word
// (the poison check: a poisoned workspace stores nothing into its peers, whose slots may be in
// use after a timeout) and its epoch (which slot the stores go to). Each thread issues those two
// loads first, then the loads of its first pass of the payload (this call's input: valid
// memory, read whether or not the workspace turns out poisoned), and only then waits, at the
// CTA barrier of the poison check, for the abort word. The payload's latency then overlaps the
// control loads' instead of following it; nothing is stored before the check. The other order
// (payload loads first) was measured slower: the abort word's load queued behind them and the
// check itself took longer. lse_reduce's small send keeps its check first: the same order there
// measured slower (docs/performance.md, "Tried").
#pragma once

#include "dcpkit_ptx.cuh"

namespace dcpkit {

// Data slots per ubatch (NOTE [dcpkit gather slots]); dcpkit/ops/_gather.py DATA_SLOTS.
constexpr u32 kGatherDataSlots = 3;
// Threads per CTA; dcpkit/ops/_gather.py THREADS. wait_all_sources needs blockDim.x >= world.
constexpr int kGatherThreads = 512;
// CTAs of one gather kernel that must fit on one SM together (launch bounds; the co-residency
// rule of NOTE [dcpkit epoch signalling] needs 2).
constexpr int kGatherMinBlocks = 2;
// 16-byte vectors each thread loads before it stores them (loads in flight per thread).
constexpr int kGatherUnroll = 4;

// The geometry of one call. A slot row holds the rows of every rank side by side: rank s's part
// of row t sits at byte s * row_vecs * 16 of that row (q_gather: one row per token, part = the
// H_r heads of rank s; kv_gather: one single row, part = rank s's whole [T, D_kv] block). The
// output `out` (copy-out) has the same layout with its own row stride.
struct GatherGeom {
  u32 rows;               // rows of the block (T for q_gather, 1 for kv_gather)
  u32 row_vecs;           // 16-byte vectors of one rank's part of a row
  long long src_stride;   // bytes between rows of the input
  long long slot_stride;  // bytes between rows of a slot
  long long out_stride;   // bytes between rows of out (copy-out only)
  u32 tokens;             // T of the call (the fingerprint's T)
};

// Vector i of a rows x row_vecs block -> (row, column in vectors). One row: no division.
__device__ __forceinline__ void gather_split(u32 rows, u32 row_vecs, u32 i, u32& row, u32& col) {
  if (rows == 1u) {
    row = 0u;
    col = i;
  } else {
    row = i / row_vecs;
    col = i - row * row_vecs;
  }
}

// The rank CTA `cta` starts with: (rank + 1 + cta) % world. Successive CTAs (and ranks) start on
// different peers, so every link carries traffic from the first store on.
__device__ __forceinline__ u32 gather_first_peer(const Proto& P) {
  const u32 w = static_cast<u32>(P.world);
  return (static_cast<u32>(P.rank) + 1u + blockIdx.x % w) % w;
}

__device__ __forceinline__ u32 gather_next_peer(const Proto& P, u32 s) {
  return (s + 1u == static_cast<u32>(P.world)) ? 0u : s + 1u;
}

// Local copy of a rows x row_vecs block of 16-byte vectors, shared by CTAs [0, ncta) of which
// this one is `cta`: thread j of them handles vectors j, j + span, j + 2 * span, ... (span =
// their threads, so a small block spreads over every one), loading kGatherUnroll of them before
// it stores them. kInput: the source is this call's read-only input (ld.global.nc); otherwise it
// is slot data written by a peer, read after a wait (ld.global.cg). `dst2`, when not null,
// receives a second copy. kPoison: nothing is read, the poison pattern is stored instead.
template <bool kInput, bool kPoison = false>
__device__ __forceinline__ void gather_copy(const char* src, long long src_stride, char* dst,
                                            long long dst_stride, char* dst2,
                                            long long dst2_stride, u32 rows, u32 row_vecs,
                                            u32 cta, u32 ncta) {
  const u32 n = rows * row_vecs;
  const u32 span = ncta * blockDim.x;  // threads of the CTAs sharing the copy
  for (u32 base = cta * blockDim.x + threadIdx.x; base < n;
       base += span * kGatherUnroll) {
    uint4 v[kGatherUnroll];
    u32 row[kGatherUnroll], col[kGatherUnroll];
#pragma unroll
    for (int k = 0; k < kGatherUnroll; ++k) {
      const u32 i = base + static_cast<u32>(k) * span;
      v[k] = make_uint4(0u, 0u, 0u, 0u);
      row[k] = 0u;
      col[k] = 0u;
      if (i < n) {
        gather_split(rows, row_vecs, i, row[k], col[k]);
        if (kPoison) {
          v[k] = make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
        } else {
          const char* p = src + row[k] * src_stride + col[k] * 16ll;
          v[k] = kInput ? ld16_nc(p) : ld16(p);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kGatherUnroll; ++k) {
      if (base + static_cast<u32>(k) * span < n) {
        st16(dst + row[k] * dst_stride + col[k] * 16ll, v[k]);
        if (dst2 != nullptr) st16(dst2 + row[k] * dst2_stride + col[k] * 16ll, v[k]);
      }
    }
  }
}

// Payload step (1) of NOTE [dcpkit epoch signalling] for a gather: this rank's block `src`
// (g.rows x g.row_vecs vectors, row stride g.src_stride) goes to column rank * row_vecs of the
// data slot at byte `slot_off` of every rank.
//   Unicast: each thread loads kGatherUnroll vectors once and stores them to every destination,
//     CTA b starting with destination (rank + 1 + b) % world; the own rank is a destination too
//     (a local store). With `own_out` (copy-out) the own block goes straight into `own_out`
//     (row stride g.out_stride) instead of the own slot: nothing reads it from there.
//   Multicast: one multimem.st per vector to `mc_data + slot_off` lands in every rank's slot,
//     the own one included (plus a local store into `own_out` with copy-out).
// The vectors a thread of the push moves in one pass (kGatherUnroll of them, span apart).
struct GatherBatch {
  uint4 v[kGatherUnroll];
  u32 row[kGatherUnroll], col[kGatherUnroll];
};

// Load the pass of the push that starts at vector `base` (span = threads of the grid).
__device__ __forceinline__ void gather_load(const char* src, const GatherGeom& g, u32 n, u32 base,
                                            u32 span, GatherBatch& b) {
#pragma unroll
  for (int k = 0; k < kGatherUnroll; ++k) {
    const u32 i = base + static_cast<u32>(k) * span;
    b.v[k] = make_uint4(0u, 0u, 0u, 0u);
    b.row[k] = 0u;
    b.col[k] = 0u;
    if (i < n) {
      gather_split(g.rows, g.row_vecs, i, b.row[k], b.col[k]);
      b.v[k] = ld16_nc(src + b.row[k] * g.src_stride + b.col[k] * 16ll);
    }
  }
}

// The first pass of this thread's push, loaded when the call starts: the loads are in flight
// while the call reads its epoch and its workspace's abort word (and, zero copy, waits for the
// credits), instead of after them (NOTE [dcpkit early payload loads]).
__device__ __forceinline__ void gather_load_first(const char* src, const GatherGeom& g,
                                                  GatherBatch& b) {
  gather_load(src, g, g.rows * g.row_vecs, blockIdx.x * blockDim.x + threadIdx.x,
              gridDim.x * blockDim.x, b);
}

// The pull's staging: this rank's block into `dst` (row stride dst_stride) and, when not null,
// `dst2`; `b` holds the first pass (gather_load_first).
__device__ __forceinline__ void gather_stage(const char* src, const GatherGeom& g, char* dst,
                                             long long dst_stride, char* dst2,
                                             long long dst2_stride, GatherBatch& b) {
  const u32 n = g.rows * g.row_vecs;
  const u32 span = gridDim.x * blockDim.x;
  const u32 start = blockIdx.x * blockDim.x + threadIdx.x;
  for (u32 base = start; base < n; base += span * kGatherUnroll) {
    if (base != start) gather_load(src, g, n, base, span, b);
#pragma unroll
    for (int k = 0; k < kGatherUnroll; ++k) {
      if (base + static_cast<u32>(k) * span < n) {
        st16(dst + b.row[k] * dst_stride + b.col[k] * 16ll, b.v[k]);
        if (dst2 != nullptr) st16(dst2 + b.row[k] * dst2_stride + b.col[k] * 16ll, b.v[k]);
      }
    }
  }
}

// `dst_tbl` (zero-copy graph outputs, Unicast; else null): the address of each peer's
// destination (its graph output buffer or its data slot), in place of `peer_data[d] + slot_off`.
// `b`: the first pass, loaded by gather_load_first; the later passes load their own.
template <Transport TR>
__device__ __forceinline__ void gather_push(const Proto& P, const u64* peer_data, u64 mc_data,
                                            u64 slot_off, const char* src, const GatherGeom& g,
                                            char* own_out, const u64* dst_tbl, GatherBatch& b) {
  const u32 n = g.rows * g.row_vecs;
  const u32 span = gridDim.x * blockDim.x;  // threads of the grid
  const long long col0 = static_cast<long long>(P.rank) * g.row_vecs * 16ll;
  const u32 first = gather_first_peer(P);
  const u32 start = blockIdx.x * blockDim.x + threadIdx.x;
  for (u32 base = start; base < n; base += span * kGatherUnroll) {
    if (base != start) gather_load(src, g, n, base, span, b);
    if (TR == Transport::Multicast) {
      char* mc = reinterpret_cast<char*>(mc_data + slot_off) + col0;
#pragma unroll
      for (int k = 0; k < kGatherUnroll; ++k) {
        if (base + static_cast<u32>(k) * span < n) {
          multimem_st16(mc + b.row[k] * g.slot_stride + b.col[k] * 16ll, b.v[k]);
          if (own_out != nullptr) {
            st16(own_out + col0 + b.row[k] * g.out_stride + b.col[k] * 16ll, b.v[k]);
          }
        }
      }
    } else {
      u32 d = first;
      for (int j = 0; j < P.world; ++j) {
        char* dst;
        long long stride;
        if (own_out != nullptr && d == static_cast<u32>(P.rank)) {
          dst = own_out + col0;
          stride = g.out_stride;
        } else {
          dst = reinterpret_cast<char*>(dst_tbl != nullptr ? dst_tbl[d]
                                                           : __ldg(peer_data + d) + slot_off) +
                col0;
          stride = g.slot_stride;
        }
#pragma unroll
        for (int k = 0; k < kGatherUnroll; ++k) {
          if (base + static_cast<u32>(k) * span < n) {
            st16(dst + b.row[k] * stride + b.col[k] * 16ll, b.v[k]);
          }
        }
        d = gather_next_peer(P, d);
      }
    }
  }
}

// Every source's part except this rank's, from a data slot into `dst` (same layout, row stride
// `dst_stride`), in units claimed from the call's work counter (parity `slot`) by every CTA that
// takes part (the waiters and the helpers) until none is left. A unit is one pass of
// kGatherUnroll vectors per thread over one source's part; consecutive units go to different
// sources so that every link (pull) or slot region (push) is busy at once.
// kFromPeers: source s's part is read from rank s's own slot over NVLink (pull); otherwise from
// this rank's slot, where the peers pushed it (copy-out after a push).
__device__ __forceinline__ u32 gather_units_per_src(const GatherGeom& g) {
  const u32 n = g.rows * g.row_vecs;
  const u32 per_unit = blockDim.x * static_cast<u32>(kGatherUnroll);
  return (n + per_unit - 1u) / per_unit;
}
// The units of gather_collect of a call (help_budget_ns and the helpers' early exit).
__device__ __forceinline__ u32 gather_units(const Proto& P, const GatherGeom& g) {
  return gather_units_per_src(g) * static_cast<u32>(P.world - 1);
}

// The waiter CTAs of a call (at most P.waiters of the grid).
__device__ __forceinline__ u32 gather_waiters(const Proto& P) {
  return P.waiters < gridDim.x ? P.waiters : gridDim.x;
}
// No more units than waiters (small T): waiter w copies unit w, without claims or helpers.
__device__ __forceinline__ bool gather_owned(const Proto& P, const GatherGeom& g) {
  return gather_units(P, g) <= gather_waiters(P);
}

// Unit c of gather_collect: pass c / (W - 1) over the part of source (rank + 1 + c % (W - 1)) % W,
// copied (or, kPoison, filled with the poison pattern).
template <bool kFromPeers, bool kPoison = false>
__device__ __forceinline__ void gather_unit(const Proto& P, const u64* peer_data, u64 slot_off,
                                            const GatherGeom& g, char* dst, long long dst_stride,
                                            u32 c) {
  const long long part_bytes = static_cast<long long>(g.row_vecs) * 16ll;
  const u32 W = static_cast<u32>(P.world);
  const u32 j = c % (W - 1u);     // which other source
  const u32 part = c / (W - 1u);  // which pass over its part
  const u32 s = (static_cast<u32>(P.rank) + 1u + j) % W;
  const u32 holder = kFromPeers ? s : static_cast<u32>(P.rank);
  const char* from =
      kPoison ? nullptr
              : reinterpret_cast<const char*>(__ldg(peer_data + holder) + slot_off) + s * part_bytes;
  gather_copy<false, kPoison>(from, g.slot_stride, dst + s * part_bytes, dst_stride, nullptr, 0,
                              g.rows, g.row_vecs, part, gather_units_per_src(g));
}

// `w`: this CTA's waiter index, or -1 for a helper. With owned units (gather_owned) waiter w
// copies unit w (if there is one) and helpers never get here; otherwise units are claimed.
template <bool kFromPeers>
__device__ __forceinline__ void gather_collect(const Proto& P, const u64* peer_data, u64 slot_off,
                                               const GatherGeom& g, char* dst,
                                               long long dst_stride, int slot, int w) {
  const u32 units = gather_units(P, g);
  if (gather_owned(P, g)) {
    if (w >= 0 && static_cast<u32>(w) < units) {
      gather_unit<kFromPeers>(P, peer_data, slot_off, g, dst, dst_stride, static_cast<u32>(w));
    }
    return;
  }
  for (u32 c = claim_work(P, slot); c < units;) {
    const u32 next = claim_issue(P, slot);  // in flight while unit c is copied
    gather_unit<kFromPeers>(P, peer_data, slot_off, g, dst, dst_stride, c);
    c = claim_publish(next);
  }
}

// A waiter whose wait failed: the elected CTA fills the whole result; with owned units the
// waiter's own unit is filled too (no unit is left stale).
__device__ __forceinline__ void gather_failed(const Proto& P, const GatherGeom& g, char* result,
                                              long long result_stride, bool elected, int w,
                                              bool copies) {
  if (elected) poison_fill16(result, result_stride, g.rows, static_cast<u32>(P.world) * g.row_vecs,
                             0u, 1u);
  if (copies && !elected && gather_owned(P, g) && static_cast<u32>(w) < gather_units(P, g)) {
    gather_unit<false, true>(P, nullptr, 0ull, g, result, result_stride, static_cast<u32>(w));
  }
}

// Largest world of a zero-copy graph call (the destination table; the host checks).
constexpr int kZeroCopyMaxWorld = 64;

// Credit of this call (NOTE [dcpkit zero-copy graph outputs]), stored by threads [0, world) of
// CTA 0 into credits[rank] of every peer; `units`: the graph output buffer's offset from data
// slot 0 in 256-byte units, 0 for a result in a slot or in out=.
__device__ __forceinline__ void gather_post_credit(const Proto& P, u32 e32, u64 units) {
  const int d = static_cast<int>(threadIdx.x);
  if (blockIdx.x == 0 && d < P.world && d != P.rank) {
    u64* credits = reinterpret_cast<u64*>(__ldg(P.peer_sig + d)) + 2 * P.world;
    st_relaxed_sys_u64(credits + P.rank, (units << 32) | static_cast<u64>(e32));
  }
}

// A zero-copy call's wait for the credit of call e32 of every peer (threads [0, world) of the
// CTA, one peer each), then dst_tbl[s] = where source s's block goes on rank s: its graph output
// buffer, or its data slot when its credit names none. Returns false (CTA-uniform) on a timeout
// (recorded) or when the workspace was poisoned meanwhile. Every thread of the CTA calls it.
__device__ __forceinline__ bool gather_wait_credits(const Proto& P, const u64* peer_data,
                                                    u64 slot_off, int sig_slot, u32 e32, u32 fp,
                                                    u64* dst_tbl) {
  const int s = static_cast<int>(threadIdx.x);
  int ok = 1;
  if (s < P.world && s != P.rank) {
    const u64* word = P.signals + 2 * P.world + s;
    u64 v = ld_relaxed_sys_u64(word);
    if (static_cast<u32>(v) != e32) {
      const u64 start = globaltimer_ns();
      u32 spins = 0;
      while (ok) {
        v = ld_relaxed_sys_u64(word);
        if (static_cast<u32>(v) == e32) break;
        if ((++spins & 255u) == 0u) {
          if (aborted(P)) {
            ok = 0;
          } else if (globaltimer_ns() - start > P.timeout_ns) {
            record_failure(P, DCPKIT_REC_TIMEOUT, sig_slot, s, e32, v, fp);
            ok = 0;
          }
        }
      }
    }
    if (ok) {
      acquire_polled(word);  // the stores below follow the peer's credit (v: the polled word)
      const u64 base = __ldg(peer_data + s);
      dst_tbl[s] = (v >> 32) != 0ull ? base + ((v >> 32) << 8) : base + slot_off;
    }
  }
  return __syncthreads_and(ok) != 0;
}

// One push gather call, steps 1-4 of NOTE [dcpkit epoch signalling].
//   peer_data : u64 [world], address of data slot 0 of this ubatch on every rank
//   slot_bytes: bytes of one data slot (data slot k at peer_data[s] + k * slot_bytes)
//   mc_data   : multicast address of data slot 0 (Multicast only)
//   src       : this rank's block, g.rows rows of g.row_vecs vectors, row stride g.src_stride
//   out       : nullptr = zero copy (the caller reads the own data slot after the kernel);
//               with bit 0 set (Unicast only): zero copy into the graph output buffer at
//               out - 1, in the slot layout (NOTE [dcpkit zero-copy graph outputs]);
//               else copy-out: the gathered rows (world * g.row_vecs vectors each, row stride
//               g.out_stride) are written to `out`.
// Every CTA publishes its own share, with no election (NOTE [dcpkit share counters] in
// dcpkit_ptx.cuh). Zero copy (either form): one waiter (the last CTA of the grid), so kernel
// completion implies that every rank's block is in the result. Copy-out: the last
// min(grid, P.waiters) CTAs wait, then share the copy with the other CTAs that find every
// source's counter within help_budget_ns (work claimed unit by unit).
// In a poisoned workspace, or after a failed wait, the elected CTA (the last waiter) fills the
// whole result with 0xFF bytes once this rank's own counter says every CTA has finished its
// stores (NOTE [dcpkit epoch signalling]).
template <Transport TR>
__device__ __forceinline__ void gather_push_call(const Proto& P, const u64* peer_data,
                                                 u64 slot_bytes, u64 mc_data, const char* src,
                                                 const GatherGeom& g, char* out) {
  DCPKIT_MARK_START();
  __shared__ u64 s_dst[kZeroCopyMaxWorld];
  // The control loads go first, then the first pass of the payload (NOTE [dcpkit early payload
  // loads]).
  const bool abort_seen = aborted(P);
  const u64 e = call_epoch(P);  // read once: the elected CTA stores e before the kernel ends
  GatherBatch batch;
  gather_load_first(src, g, batch);
  const u32 e32 = static_cast<u32>(e);
  const int sig_slot = static_cast<int>(e & 1ull);
  const u64 slot_off = (e % kGatherDataSlots) * slot_bytes;
  const bool zc = TR == Transport::Unicast && (reinterpret_cast<u64>(out) & 1ull) != 0ull;
  if (zc) out = reinterpret_cast<char*>(reinterpret_cast<u64>(out) - 1ull);
  if (TR == Transport::Unicast) {
    gather_post_credit(P, e32, zc ? (reinterpret_cast<u64>(out) - __ldg(peer_data + P.rank)) >> 8
                                  : 0ull);
  }
  char* result = out != nullptr ? out
                                : reinterpret_cast<char*>(__ldg(peer_data + P.rank) + slot_off);
  const long long result_stride = out != nullptr ? g.out_stride : g.slot_stride;
  DCPKIT_MARK_ENTRY(e);
  // Poisoned (CTA-uniform): store nothing, publish a skipped share, the elected CTA fills the
  // result.
  const bool dead = __syncthreads_or(abort_seen ? 1 : 0) != 0;
  DCPKIT_MARK(e, 1u);
  const u32 fp = call_fingerprint(P, g.tokens, 0u, false, false) |
                 ((zc ? 1u : 0u) << DCPKIT_FP_ZC_SHIFT);
  // A zero-copy graph call stores only after every peer's credit (a CTA whose wait failed stores
  // nothing and arrives as one that skipped: no signal goes out).
  const bool skip =
      dead || (zc && !gather_wait_credits(P, peer_data, slot_off, sig_slot, e32, fp, s_dst));

  if (!skip) {
    gather_push<TR>(P, peer_data, mc_data, slot_off, src, g, out, zc ? s_dst : nullptr, batch);
  }
  DCPKIT_MARK(e, 2u);
  const bool copies = out != nullptr && !zc;  // copy-out from the own slot after the wait
  const u32 k = copies ? P.waiters : 1u;
  // Publish by shares, no election (NOTE [dcpkit share counters] in dcpkit_ptx.cuh).
  publish_shares<TR>(P, e, sig_slot, fp, skip);
  const int w = share_waiter(k);
  DCPKIT_MARK(e, 3u);
  DCPKIT_MARK_ROLE(e, w < 0 ? 0ull : static_cast<u64>(w) + 1ull);
  if (w < 0) {  // not a waiter: help with the copy-out if every source is there soon
    if (!copies || dead || gather_owned(P, g) ||
        !try_all_shares(P, sig_slot, e, fp, gather_units(P, g))) {
      DCPKIT_MARK(e, 5u);
      return;
    }
    DCPKIT_MARK(e, 4u);
    gather_collect<false>(P, peer_data, slot_off, g, out, g.out_stride, sig_slot, -1);
    DCPKIT_MARK(e, 5u);
    return;
  }
  const u32 nw = k < gridDim.x ? k : gridDim.x;
  const bool elected = static_cast<u32>(w) == nw - 1u;
  // Every CTA of the kernel has read the epoch and finished its stores once waiter_shares
  // returns (also after a failed wait: settle_own_shares), and the elected CTA has stored the
  // new epoch. It poisons the whole result when a CTA stored nothing or a wait failed; with
  // owned units a failed waiter also poisons its unit; the other waiters just return.
  if (!waiter_shares(P, sig_slot, e, fp, dead, elected)) {
    gather_failed(P, g, result, result_stride, elected, w, copies);
    DCPKIT_MARK(e, 5u);
    return;
  }
  DCPKIT_MARK(e, 4u);
  if (copies) gather_collect<false>(P, peer_data, slot_off, g, out, g.out_stride, sig_slot, w);
  DCPKIT_MARK(e, 5u);
}

// One pull gather call (unicast only).
//   (a) every CTA copies its share of the own input into the own data slot, column rank (and
//       into `out` with copy-out);
//   (b) publish: this rank's signal now means "my block is staged in my slot";
//   (c) the last min(grid, P.waiters) CTAs wait for every source (the others help if every
//       source is there within help_budget_ns), then they load source s's block from rank s's slot
//       over NVLink into the same place of the own slot (or of `out`), unit by unit.
// Slot reuse stays safe (same argument as NOTE [dcpkit epoch signalling], reads instead of
// writes): this rank rewrites its data slot k (staging, step a) only at call n + 3; that call
// starts after its call n + 2, whose waiters all waited for every peer's n + 2 signal, and a peer
// publishes n + 2 only inside its call n + 2, after its call n -- including every load it made
// from this rank's slot -- retired. Peers never write into this rank's slot, so the view rule of
// NOTE [dcpkit gather slots] holds as well (pull alone would even allow two slots).
__device__ __forceinline__ void gather_pull_call(const Proto& P, const u64* peer_data,
                                                 u64 slot_bytes, const char* src,
                                                 const GatherGeom& g, char* out) {
  DCPKIT_MARK_START();
  // The control loads, then the first pass of the staging (NOTE [dcpkit early payload loads]).
  const bool abort_seen = aborted(P);
  const u64 e = call_epoch(P);
  GatherBatch batch;
  gather_load_first(src, g, batch);
  const u32 e32 = static_cast<u32>(e);
  const int sig_slot = static_cast<int>(e & 1ull);
  const u64 slot_off = (e % kGatherDataSlots) * slot_bytes;
  char* own_slot = reinterpret_cast<char*>(__ldg(peer_data + P.rank) + slot_off);
  char* result = out != nullptr ? out : own_slot;
  const long long result_stride = out != nullptr ? g.out_stride : g.slot_stride;
  DCPKIT_MARK_ENTRY(e);
  // Poisoned (CTA-uniform): store nothing, arrive, the elected CTA fills the result.
  const bool dead = __syncthreads_or(abort_seen ? 1 : 0) != 0;
  DCPKIT_MARK(e, 1u);
  const u32 fp = call_fingerprint(P, g.tokens, 0u, false, false);
  const long long col0 = static_cast<long long>(P.rank) * g.row_vecs * 16ll;

  if (!dead) {
    gather_stage(src, g, own_slot + col0, g.slot_stride, out == nullptr ? nullptr : out + col0,
                 g.out_stride, batch);
  }
  DCPKIT_MARK(e, 2u);
  bool published;
  const int w = arrive_and_publish<Transport::Unicast>(P, e, sig_slot, fp, P.waiters, dead,
                                                    published);
  DCPKIT_MARK(e, 3u);
  DCPKIT_MARK_ROLE(e, w < 0 ? 0ull : static_cast<u64>(w) + 1ull);
  if (w < 0) {  // not a waiter: help with the loads if every source is there soon
    if (dead || gather_owned(P, g) || !try_all_sources(P, sig_slot, e32, fp, gather_units(P, g))) {
      DCPKIT_MARK(e, 5u);
      return;
    }
    DCPKIT_MARK(e, 4u);
    gather_collect<true>(P, peer_data, slot_off, g, result, result_stride, sig_slot, -1);
    DCPKIT_MARK(e, 5u);
    return;
  }
  const u32 nw = gather_waiters(P);
  const bool elected = static_cast<u32>(w) == nw - 1u;
  if ((elected && !published) || (!elected && dead) || !wait_all_sources(P, sig_slot, e32, fp)) {
    gather_failed(P, g, result, result_stride, elected, w, true);
    DCPKIT_MARK(e, 5u);
    return;
  }
  DCPKIT_MARK(e, 4u);
  gather_collect<true>(P, peer_data, slot_off, g, result, result_stride, sig_slot, w);
  DCPKIT_MARK(e, 5u);
}

}  // namespace dcpkit
