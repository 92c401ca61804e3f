// protocol_probe.cu: what each step of a small exchange costs on this machine, one step at a time
// (scripts/protocol_probe.py; never launched by the ops). One kernel moves every rank's block of
// `nvec` 16-byte vectors to every peer with the gathers' grid shape (512 threads per CTA, a
// grid-stride loop) and the steps that `features` switches on, so that two runs differing in one
// bit measure that step alone:
//
//   features == 0      the floor kernel's protocol (kernels/ceilings.cu): payload stores, CTA
//                      barrier, one fence.acq_rel.sys and one relaxed signal store per peer by
//                      every CTA (word (c, rank) of each peer: no election), relaxed polls of
//                      CTA c's word of every peer plus one acquire; per-CTA epochs.
//   kProbePoison       the ops' poison check: every thread loads the abort word with its first
//                      payload loads, and the CTA agrees on it (__syncthreads_or) before storing.
//   kProbeElect        the ops' election (NOTE [dcpkit epoch signalling], step 2): thread 0 of
//                      every CTA adds to one arrival counter (atom.acq_rel.gpu); the last CTA
//                      stores the epoch, fences once and signals every peer; it alone waits for
//                      the peers' signals (a zero-copy call: one waiter). One shared epoch.
//   kProbeCredit       the credits of a zero-copy graph call (NOTE [dcpkit zero-copy graph
//                      outputs] in gather.cuh): CTA 0 stores a credit into every peer when it
//                      starts; every CTA waits for every peer's credit before its stores.
//   kProbeLL           flags inside the data instead of a fence and a signal: every 16-byte vector
//                      goes out as two 16-byte stores of two 64-bit words (32 bits of data, 32
//                      bits of epoch each; st.relaxed.sys.v2.u64, every 64-bit word single-copy
//                      atomic), and CTAs [0, recv_ctas) poll this rank's copies of those words
//                      until every flag shows the epoch, then store the data into `out` (the
//                      receiver must copy: its lines carry flags). With kProbeElect the epoch is
//                      the shared one and every CTA arrives at the end (the last stores it);
//                      without, per-CTA epochs and no atomics.
//   kProbeCounter      a publish without an election (in place of the fence-and-flag one): thread
//                      0 of every CTA fences once and adds its share of 2**20 (the shares of a
//                      grid sum to 2**20, whatever its size) to a 64-bit counter per source on
//                      every rank, its own included (red.relaxed.sys.add: no round trip); the
//                      last CTA alone waits until every source's counter has reached
//                      e * 2**20, then stores the shared epoch (its own rank's counter says
//                      every CTA of its kernel has read it).
//   kProbeSigWord      with kProbeCounter, the push gathers' signal word (NOTE [dcpkit share
//                      counters]): thread 0 of CTA 0 stores a word (fingerprint << 32 | e) into
//                      word (p, 0, rank) of every rank before its fence; the waiter loads that
//                      word beside every poll of the counter and requires it to be this call's
//                      (read once more after the acquire when it is not), as the op does.
//
// Heap layout (symmetric, the same on every rank; zeroed by the host before a configuration):
//   [0, 2 * world * slot_bytes)   data: parity p, source s at (p * world + s) * slot_bytes
//   sig_off                       u64 [2][max_ctas][world]: word (p, c, s) written by CTA c of s
//                                 (kProbeElect: c = 0, by the elected CTA; kProbeSigWord: c = 0,
//                                 by CTA 0)
//   cred_off                      u64 [world]: credit of rank s (the epoch of its latest call),
//                                 then u64 [world]: the counter of source s (kProbeCounter)
// Local memory: epochs u64 [max_ctas] (kProbeElect: word 0 only), arrive u32, abort_word u32
// (always 0: the check is timed, never taken), status u32 [grid] (0 = every wait of the CTA
// completed, 1 = a wait timed out), out [world][nvec] vectors (kProbeLL only).
// Every CTA of the kernel may wait (the host caps the grid at the rank's SM share, as the floor
// kernel does); every wait has a deadline.
#include "dcpkit_ptx.cuh"

namespace dcpkit {

constexpr u32 kProbePoison = 1u;
constexpr u32 kProbeElect = 2u;
constexpr u32 kProbeCredit = 4u;
constexpr u32 kProbeLL = 8u;
constexpr u32 kProbeCounter = 16u;
constexpr u32 kProbeSigWord = 32u;
constexpr u32 kProbeSigFp = 0x5EC0DEu;  // the signal word's fingerprint (any constant)
constexpr int kProbeThreads = 512;
constexpr int kProbeUnroll = 4;

__device__ __forceinline__ void st_relaxed_sys_v2_u64(void* p, u64 a, u64 b) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1,%2};" :: "l"(p), "l"(a), "l"(b)
               : "memory");
}
__device__ __forceinline__ void ld_relaxed_sys_v2_u64(const void* p, u64& a, u64& b) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0,%1}, [%2];" : "=l"(a), "=l"(b) : "l"(p)
               : "memory");
}
// Relaxed polls of the counter `word` until it has reached `target` (wrap-safe), then one
// acquire; false at the deadline.
__device__ __forceinline__ bool probe_wait_reached(const u64* word, u64 target, u64 timeout_ns) {
  if (static_cast<long long>(ld_relaxed_sys_u64(word) - target) < 0) {
    const u64 start = globaltimer_ns();
    u32 spins = 0;
    while (static_cast<long long>(ld_relaxed_sys_u64(word) - target) < 0) {
      if ((++spins & 255u) == 0u && globaltimer_ns() - start > timeout_ns) return false;
    }
  }
  acquire_polled(word);
  return true;
}
// probe_wait_reached with the op's signal word: `sig` loaded beside every poll of `word`; after
// the acquire it must equal `want` (loaded once more when it does not yet).
__device__ __forceinline__ bool probe_wait_reached_sig(const u64* word, const u64* sig, u64 target,
                                                       u64 want, u64 timeout_ns) {
  u64 w = ld_relaxed_sys_u64(sig);
  if (static_cast<long long>(ld_relaxed_sys_u64(word) - target) < 0) {
    const u64 start = globaltimer_ns();
    u32 spins = 0;
    while (true) {
      const u64 v = ld_relaxed_sys_u64(word);
      w = ld_relaxed_sys_u64(sig);
      if (static_cast<long long>(v - target) >= 0) break;
      if ((++spins & 255u) == 0u && globaltimer_ns() - start > timeout_ns) return false;
    }
  }
  acquire_polled(word);
  return w == want || ld_relaxed_sys_u64(sig) == want;
}
__device__ __forceinline__ bool probe_flags_are(u64 a, u64 b, u64 c, u64 d, u32 e) {
  return static_cast<u32>(a >> 32) == e && static_cast<u32>(b >> 32) == e &&
         static_cast<u32>(c >> 32) == e && static_cast<u32>(d >> 32) == e;
}

// Relaxed polls of `word` until its low half equals e, then one acquire; false at the deadline.
__device__ __forceinline__ bool probe_wait(const u64* word, u32 e, u64 timeout_ns) {
  if (static_cast<u32>(ld_relaxed_sys_u64(word)) != e) {
    const u64 start = globaltimer_ns();
    u32 spins = 0;
    while (static_cast<u32>(ld_relaxed_sys_u64(word)) != e) {
      if ((++spins & 255u) == 0u && globaltimer_ns() - start > timeout_ns) return false;
    }
  }
  acquire_polled(word);
  return true;
}

__global__ void __launch_bounds__(kProbeThreads, 2)
protocol_probe_kernel(const uint4* __restrict__ src, u64 nvec, const u64* __restrict__ peer_base,
                      u64 slot_bytes, u64 sig_off, u64 cred_off, u64* epochs, u32* arrive,
                      const u32* abort_word, u32* status, uint4* out, int rank, int world,
                      u64 timeout_ns, u32 features, u32 recv_ctas, u32 max_ctas) {
  const bool counter = (features & kProbeCounter) != 0u;
  const bool elect = (features & kProbeElect) != 0u && !counter;
  const bool ll = (features & kProbeLL) != 0u;
  const u32 cta = blockIdx.x;
  const u64 e = *reinterpret_cast<volatile u64*>(epochs + (elect || counter ? 0u : cta)) + 1ull;
  const u32 e32 = static_cast<u32>(e);
  const u64 par = e & 1ull;
  u32 abort_seen = 0u;
  if (features & kProbePoison) abort_seen = *reinterpret_cast<const volatile u32*>(abort_word);
  const u64 span = static_cast<u64>(gridDim.x) * blockDim.x;
  const u64 start = static_cast<u64>(cta) * blockDim.x + threadIdx.x;
  uint4 v[kProbeUnroll];
#pragma unroll
  for (int k = 0; k < kProbeUnroll; ++k) {
    const u64 i = start + static_cast<u64>(k) * span;
    v[k] = i < nvec ? ld16_nc(src + i) : make_uint4(0u, 0u, 0u, 0u);
  }
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  bool dead = false;
  if (features & kProbePoison) dead = __syncthreads_or(abort_seen != 0u ? 1 : 0) != 0;
  if (features & kProbeCredit) {
    const int d = static_cast<int>(threadIdx.x);
    if (cta == 0u && d < world && d != rank) {
      st_relaxed_sys_u64(reinterpret_cast<u64*>(peer_base[d] + cred_off) + rank, e);
    }
    int ok = 1;
    if (d < world && d != rank) {
      ok = probe_wait(reinterpret_cast<const u64*>(peer_base[rank] + cred_off) + d, e32,
                      timeout_ns) ? 1 : 0;
    }
    if (!__syncthreads_and(ok)) dead = true;
  }
  __syncthreads();
  if (dead) s_ok = 0;

  // payload
  if (!dead) {
    for (u64 base = start; base < nvec; base += span * kProbeUnroll) {
      if (base != start) {
#pragma unroll
        for (int k = 0; k < kProbeUnroll; ++k) {
          const u64 i = base + static_cast<u64>(k) * span;
          v[k] = i < nvec ? ld16_nc(src + i) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
      int peer = rank + 1 + static_cast<int>(cta % static_cast<u32>(world));
      while (peer >= world) peer -= world;
      for (int j = 0; j < world; ++j, peer = (peer + 1 == world) ? 0 : peer + 1) {
        if (peer == rank) continue;
        char* slot = reinterpret_cast<char*>(peer_base[peer]) +
                     (par * static_cast<u64>(world) + static_cast<u64>(rank)) * slot_bytes;
#pragma unroll
        for (int k = 0; k < kProbeUnroll; ++k) {
          const u64 i = base + static_cast<u64>(k) * span;
          if (i >= nvec) continue;
          if (ll) {
            const u64 f = static_cast<u64>(e32) << 32;
            char* p = slot + i * 32ull;
            st_relaxed_sys_v2_u64(p, v[k].x | f, v[k].y | f);
            st_relaxed_sys_v2_u64(p + 16, v[k].z | f, v[k].w | f);
          } else {
            st16(reinterpret_cast<uint4*>(slot) + i, v[k]);
          }
        }
      }
      if (ll) {
#pragma unroll
        for (int k = 0; k < kProbeUnroll; ++k) {
          const u64 i = base + static_cast<u64>(k) * span;
          if (i < nvec) st16(out + static_cast<u64>(rank) * nvec + i, v[k]);
        }
      }
    }
  }

  if (ll) {  // receive: poll the flags, copy the data out
    int ok = 1;
    if (cta < recv_ctas && !dead) {
      const u64 rspan = static_cast<u64>(recv_ctas) * blockDim.x;
      const char* mine = reinterpret_cast<const char*>(peer_base[rank]);
      for (u64 i = static_cast<u64>(cta) * blockDim.x + threadIdx.x; i < nvec && ok; i += rspan) {
        int s = rank;
        for (int j = 1; j < world && ok; ++j) {
          s = (s + 1 == world) ? 0 : s + 1;
          const char* p = mine + (par * static_cast<u64>(world) + static_cast<u64>(s)) * slot_bytes +
                          i * 32ull;
          u64 a, b, c, d;
          ld_relaxed_sys_v2_u64(p, a, b);
          ld_relaxed_sys_v2_u64(p + 16, c, d);
          if (!probe_flags_are(a, b, c, d, e32)) {
            const u64 t0 = globaltimer_ns();
            u32 spins = 0;
            do {
              ld_relaxed_sys_v2_u64(p, a, b);
              ld_relaxed_sys_v2_u64(p + 16, c, d);
              if ((++spins & 255u) == 0u && globaltimer_ns() - t0 > timeout_ns) ok = 0;
            } while (ok && !probe_flags_are(a, b, c, d, e32));
          }
          st16(out + static_cast<u64>(s) * nvec + i,
               make_uint4(static_cast<u32>(a), static_cast<u32>(b), static_cast<u32>(c),
                          static_cast<u32>(d)));
        }
      }
    }
    if (!__syncthreads_and(ok)) s_ok = 0;
    if (threadIdx.x == 0) {
      if (elect) {
        const u32 prev = atom_add_acq_rel_gpu(arrive, 1u);
        if (prev == gridDim.x - 1u) {
          *reinterpret_cast<volatile u32*>(arrive) = 0u;
          *reinterpret_cast<volatile u64*>(epochs) = e;
        }
      } else {
        epochs[cta] = e;
      }
      status[cta] = s_ok ? 0u : 1u;
    }
    return;
  }

  // publish and wait (fence + flag)
  __syncthreads();
  u64* sig = reinterpret_cast<u64*>(peer_base[rank] + sig_off);  // this rank's words
  const u64 sig_par = par * static_cast<u64>(max_ctas) * static_cast<u64>(world);
  if (counter) {
    const u64 cnt_off = cred_off + 8ull * static_cast<u64>(world);
    constexpr u64 kUnit = 1ull << 20;
    const u64 share = kUnit / gridDim.x + (cta < kUnit % gridDim.x ? 1ull : 0ull);
    const bool sigword = (features & kProbeSigWord) != 0u;
    const u64 word = (static_cast<u64>(kProbeSigFp) << 32) | e32;
    if (threadIdx.x == 0) {
      if (sigword && cta == 0u) {
        for (int d = 0; d < world; ++d) {
          st_relaxed_sys_u64(reinterpret_cast<u64*>(peer_base[d] + sig_off) + sig_par + rank,
                             word);
        }
      }
      fence_acq_rel_sys();
      int d = rank;
      for (int j = 0; j < world; ++j) {  // peers first, this rank last
        d = (d + 1 == world) ? 0 : d + 1;
        red_relaxed_sys_add_u64(reinterpret_cast<u64*>(peer_base[d] + cnt_off) + rank, share);
      }
    }
    if (cta + 1u != gridDim.x) {
      if (threadIdx.x == 0) status[cta] = s_ok ? 0u : 1u;
      return;
    }
    const u64* cnt = reinterpret_cast<const u64*>(peer_base[rank] + cnt_off);
    const int s = static_cast<int>(threadIdx.x);
    int ok = 1;
    if (s < world) {
      ok = (sigword ? probe_wait_reached_sig(cnt + s, sig + sig_par + s, e * kUnit, word,
                                             timeout_ns)
                    : probe_wait_reached(cnt + s, e * kUnit, timeout_ns))
               ? 1
               : 0;
    }
    if (!__syncthreads_and(ok)) s_ok = 0;
    if (threadIdx.x == 0) {
      *reinterpret_cast<volatile u64*>(epochs) = e;
      status[cta] = s_ok ? 0u : 1u;
    }
    return;
  }
  if (elect) {
    __shared__ int s_elected;
    if (threadIdx.x == 0) {
      const u32 prev = atom_add_acq_rel_gpu(arrive, 1u);
      s_elected = prev == gridDim.x - 1u ? 1 : 0;
      if (s_elected) {
        *reinterpret_cast<volatile u32*>(arrive) = 0u;
        *reinterpret_cast<volatile u64*>(epochs) = e;
        fence_acq_rel_sys();
        int d = rank;
        for (int j = 1; j < world; ++j) {
          d = (d + 1 == world) ? 0 : d + 1;
          st_relaxed_sys_u64(reinterpret_cast<u64*>(peer_base[d] + sig_off) + sig_par + rank,
                             signal_word(e, 0u));
        }
      }
    }
    __syncthreads();
    if (!s_elected) {
      if (threadIdx.x == 0) status[cta] = s_ok ? 0u : 1u;
      return;
    }
    const int s = static_cast<int>(threadIdx.x);
    int ok = 1;
    if (s < world && s != rank) ok = probe_wait(sig + sig_par + s, e32, timeout_ns) ? 1 : 0;
    if (!__syncthreads_and(ok)) s_ok = 0;
  } else {
    if (threadIdx.x == 0) {
      fence_acq_rel_sys();
      int d = rank;
      for (int j = 1; j < world; ++j) {
        d = (d + 1 == world) ? 0 : d + 1;
        st_relaxed_sys_u64(reinterpret_cast<u64*>(peer_base[d] + sig_off) + sig_par +
                               static_cast<u64>(cta) * world + rank,
                           signal_word(e, 0u));
      }
    }
    const int s = static_cast<int>(threadIdx.x);
    int ok = 1;
    if (s < world && s != rank) {
      ok = probe_wait(sig + sig_par + static_cast<u64>(cta) * world + s, e32, timeout_ns) ? 1 : 0;
    }
    if (!__syncthreads_and(ok)) s_ok = 0;
    if (threadIdx.x == 0) epochs[cta] = e;
  }
  if (threadIdx.x == 0) status[cta] = s_ok ? 0u : 1u;
}

}  // namespace dcpkit
