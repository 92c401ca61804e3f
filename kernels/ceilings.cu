// ceilings.cu: the kernels `python -m dcpkit bench` measures the machine's physical limits with,
// so that every benchmark figure can be stated as a ratio to a limit measured in the same run.
//
//   pingpong_kernel  one-way NVLink latency: a signal bounced between two ranks, many round trips
//                    inside one launch (the same st.release.sys / ld.acquire.sys pair the ops'
//                    epoch signals use, NOTE [dcpkit epoch signalling] in dcpkit_ptx.cuh).
//   egress_kernel    unicast egress bandwidth: every rank stores its slice into every peer at once
//                    with 16-byte stores (the payload path of the gathers). With nvec = 0 it is
//                    an empty kernel, used to measure the launch cost.
//   barrier_kernel   a device-side barrier over the ranks, launched before every timed region so
//                    that the ranks' timed regions start together (not part of any timed region).
//   floor_kernel     the floor of an op: the minimal exchange that moves the op's egress bytes
//                    with the op's CTA count and the minimal publish / wait protocol, timed
//                    exactly like the op (dcpkit/bench/floor.py).
//
// Every wait has a deadline (%globaltimer): on expiry the kernel writes a status word and returns,
// it never hangs. The host (dcpkit/bench.py) reads the status after synchronising.
#include "dcpkit_ptx.cuh"

namespace dcpkit {

// Poll `word` with ld.acquire.sys until it equals `expected`; false once `timeout_ns` passed.
__device__ __forceinline__ bool poll_equal(const u32* word, u32 expected, u64 timeout_ns) {
  if (ld_acquire_sys(word) == expected) return true;
  const u64 start = globaltimer_ns();
  u32 spins = 0;
  while (ld_acquire_sys(word) != expected) {
    if ((++spins & 1023u) == 0u && globaltimer_ns() - start > timeout_ns) return false;
  }
  return true;
}

// One-way latency. Launched with one thread on rank 0 (initiator = 1) and on rank 1
// (initiator = 0). Round trip i (1-based) uses the value base + i:
//   initiator: st.release.sys(peer_word, v); poll local_word == v
//   responder: poll local_word == v;         st.release.sys(peer_word, v)
// Values only grow from launch to launch (the host advances `base` by round_trips + 1), so a value
// left by an earlier launch never satisfies a wait of a later one.
// status[0]: 0 = all round trips done, 1 = a wait timed out; status[1]: round trips completed.
// elapsed_ns[0]: %globaltimer time of round trips (warm, round_trips] (a cross-check of the event
// timing that excludes the launch skew between the two ranks).
__global__ void pingpong_kernel(u32* local_word, u32* peer_word, int initiator, u32 base,
                                int round_trips, int warm, u64 timeout_ns, u32* status,
                                u64* elapsed_ns) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  u64 t0 = globaltimer_ns();
  for (int i = 1; i <= round_trips; ++i) {
    const u32 v = base + static_cast<u32>(i);
    if (i == warm + 1) t0 = globaltimer_ns();
    if (initiator) {
      st_release_sys(peer_word, v);
      if (!poll_equal(local_word, v, timeout_ns)) {
        status[0] = 1u;
        status[1] = static_cast<u32>(i - 1);
        return;
      }
    } else {
      if (!poll_equal(local_word, v, timeout_ns)) {
        status[0] = 1u;
        status[1] = static_cast<u32>(i - 1);
        return;
      }
      st_release_sys(peer_word, v);
    }
  }
  elapsed_ns[0] = globaltimer_ns() - t0;
  status[0] = 0u;
  status[1] = static_cast<u32>(round_trips);
}

// Poll `word` until it has reached `target` (wrap-safe: the signed distance is >= 0); false once
// `timeout_ns` passed. For counters that only grow, where a waiter may see a later value first.
__device__ __forceinline__ bool poll_reached(const u32* word, u32 target, u64 timeout_ns) {
  if (static_cast<int>(ld_acquire_sys(word) - target) >= 0) return true;
  const u64 start = globaltimer_ns();
  u32 spins = 0;
  while (static_cast<int>(ld_acquire_sys(word) - target) < 0) {
    if ((++spins & 1023u) == 0u && globaltimer_ns() - start > timeout_ns) return false;
  }
  return true;
}

// Unicast egress. src: this rank's slice, nvec 16-byte vectors (16-byte aligned). dst[p]: the
// address in rank p's memory where this rank's slice goes (dst[rank] is not used). Every thread
// loads kUnroll vectors, then stores them into every peer, starting with peer rank + 1 so that the
// ranks do not all hit the same destination first. Ends with fence.sc.sys, as the ops do before
// they publish, so the kernel's time covers the remote stores' completion.
// Launch: a grid-stride loop; any grid and block size.
__global__ void egress_kernel(const uint4* __restrict__ src, const u64* __restrict__ dst, int rank,
                              int world, u64 nvec) {
  if (nvec == 0) return;  // the empty kernel of the launch-cost measurement
  constexpr int kUnroll = 4;
  const u64 nthreads = static_cast<u64>(gridDim.x) * static_cast<u64>(blockDim.x);
  const u64 tid = static_cast<u64>(blockIdx.x) * static_cast<u64>(blockDim.x) + threadIdx.x;
  for (u64 i0 = tid; i0 < nvec; i0 += nthreads * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const u64 i = i0 + static_cast<u64>(u) * nthreads;
      v[u] = (i < nvec) ? ld16_nc(src + i) : make_uint4(0u, 0u, 0u, 0u);
    }
    for (int j = 1; j < world; ++j) {
      int peer = rank + j;
      if (peer >= world) peer -= world;
      uint4* d = reinterpret_cast<uint4*>(dst[peer]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const u64 i = i0 + static_cast<u64>(u) * nthreads;
        if (i < nvec) st16(d + i, v[u]);
      }
    }
  }
  fence_sc_sys();
}

// Device barrier over `world` ranks. local_words: u32 [world] in this rank's symmetric memory,
// word s written only by rank s. peer_words[p]: address of rank p's words. Thread t < world
// stores `value` into word `rank` of rank t (st.release.sys), then waits until word t of its own
// copy has reached `value`. The host passes a value one higher on every launch (equal on every
// rank, and never lower after a failure: the host resynchronises to the largest count). The wait
// is "reached", not "equal": a fast peer may leave this barrier and store the next value before
// this thread has read the current one. On a timeout it stores 1 into *status (host-mapped
// memory) and returns. One CTA, blockDim.x >= world.
__global__ void barrier_kernel(u32* local_words, const u64* __restrict__ peer_words, int rank,
                               int world, u32 value, u64 timeout_ns, u32* status) {
  const int t = static_cast<int>(threadIdx.x);
  if (blockIdx.x != 0 || t >= world) return;
  st_release_sys(reinterpret_cast<u32*>(peer_words[t]) + rank, value);
  if (!poll_reached(local_words + t, value, timeout_ns)) st_relaxed_sys(status, 1u);
}

// Poll `word` with relaxed loads until it has reached `target` (wrap-safe), then one acquire load;
// false once `timeout_ns` passed. The acquire pairs with the writer's fence.acq_rel.sys + relaxed
// store (a release pattern): payload stores before the writer's fence are visible after it.
__device__ __forceinline__ bool poll_reached_relaxed(const u32* word, u32 target, u64 timeout_ns) {
  if (static_cast<int>(ld_relaxed_sys(word) - target) < 0) {
    const u64 start = globaltimer_ns();
    u32 spins = 0;
    while (static_cast<int>(ld_relaxed_sys(word) - target) < 0) {
      if ((++spins & 1023u) == 0u && globaltimer_ns() - start > timeout_ns) return false;
    }
  }
  (void)ld_acquire_sys(word);
  return true;
}

// The floor kernel: what any op that sends `nvec` 16-byte vectors to every peer must at least do.
//
//   src        this rank's payload, nvec vectors (16-byte aligned).
//   peer_base  [world] base address of every rank's floor heap, as mapped here (own included).
//   Heap layout (same on every rank): `world` slots of `slot_bytes` (slot s holds what rank s
//   sent here), then at `sig_off` the signals u32 [gridDim.x][world]: word (c, s) is written
//   only by CTA c of rank s.
//   epochs     u32 [gridDim.x] in ordinary device memory: CTA c's call count, read and written
//              only by CTA c (no election, no atomics); graph replays advance it.
//   status     u32 [gridDim.x]: each call writes 0 when every wait of CTA c completed, 1 when one
//              timed out (the host poisons it before a check, so a call that never ran shows).
//
// CTA c stores its contiguous share of the payload into every peer (peer rank + 1 first, as the
// egress kernel does), CTA barrier; then its thread 0 alone: one fence.acq_rel.sys, one relaxed
// store of the epoch per peer, relaxed polling of the signal of CTA c of every peer plus one
// acquire each, with a deadline. Every rank launches the same grid, so CTA c's waits cover CTA c's
// share from every peer. Waits test "reached" (a peer may already be one call ahead). All CTAs
// must be co-resident (the host caps the grid like the ops do).
__global__ void floor_kernel(const uint4* __restrict__ src, u64 nvec, const u64* __restrict__ peer_base,
                             u64 slot_bytes, u64 sig_off, u32* __restrict__ epochs, int rank,
                             int world, u64 timeout_ns, u32* __restrict__ status) {
  DCPKIT_MARK_START();
  constexpr int kUnroll = 4;
  const int c = static_cast<int>(blockIdx.x);
  const u64 per = (nvec + gridDim.x - 1) / gridDim.x;
  const u64 begin = static_cast<u64>(c) * per;
  const u64 end = begin + per < nvec ? begin + per : nvec;
  const u64 step = static_cast<u64>(blockDim.x);
#if DCPKIT_TIMELINE
  const u64 tl_call = epochs[c] + 1u;  // read by thread 0 before it stores the new value
  DCPKIT_MARK_ENTRY(tl_call);
  DCPKIT_MARK_ROLE(tl_call, 1ull);
#endif
  for (u64 i0 = begin + threadIdx.x; i0 < end; i0 += step * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const u64 i = i0 + static_cast<u64>(u) * step;
      v[u] = (i < end) ? ld16_nc(src + i) : make_uint4(0u, 0u, 0u, 0u);
    }
    for (int j = 1; j < world; ++j) {
      int peer = rank + j;
      if (peer >= world) peer -= world;
      uint4* d = reinterpret_cast<uint4*>(peer_base[peer] + static_cast<u64>(rank) * slot_bytes);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const u64 i = i0 + static_cast<u64>(u) * step;
        if (i < end) st16(d + i, v[u]);
      }
    }
  }
  __syncthreads();
#if DCPKIT_TIMELINE
  DCPKIT_MARK(tl_call, 2u);
#endif
  if (threadIdx.x == 0) {
    const u32 e = epochs[c] + 1u;
    const u64 word = sig_off + 4ull * (static_cast<u64>(c) * world);
    fence_acq_rel_sys();
    for (int j = 1; j < world; ++j) {
      int peer = rank + j;
      if (peer >= world) peer -= world;
      st_relaxed_sys(reinterpret_cast<u32*>(peer_base[peer] + word) + rank, e);
    }
#if DCPKIT_TIMELINE
    DCPKIT_MARK(tl_call, 3u);
#endif
    const u32* mine = reinterpret_cast<const u32*>(peer_base[rank] + word);
    u32 ok = 1u;
    for (int s = 0; s < world && ok; ++s) {
      if (s != rank && !poll_reached_relaxed(mine + s, e, timeout_ns)) ok = 0u;
    }
#if DCPKIT_TIMELINE
    DCPKIT_MARK(tl_call, 4u);
#endif
    epochs[c] = e;
    status[c] = ok ? 0u : 1u;
  }
  __syncthreads();
#if DCPKIT_TIMELINE
  DCPKIT_MARK(tl_call, 5u);
#endif
}

}  // namespace dcpkit
