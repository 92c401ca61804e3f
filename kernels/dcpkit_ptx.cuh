// dcpkit_ptx.cuh: every piece of inline PTX dcpkit uses, the element types, and the epoch
// signalling protocol shared by all ops. Kernels include this header and nothing else.
//
// NOTE [dcpkit epoch signalling]
// ------------------------------
// Every op workspace owns, per ubatch:
//   * epoch   : a 64-bit counter in ordinary device memory. A call reads it, uses e = epoch + 1,
//               and the last CTA to finish stores e back. It is advanced on the device, inside the
//               op's own kernel, so CUDA-graph replays advance it too.
//   * signals : u32 [2][world_size] in symmetric memory. signals[slot][s] on rank r is written
//               only by rank s, with the low 32 bits of s's epoch. slot = e & 1.
//   * slots   : data regions double-buffered by slot.
// A call at epoch e on rank r:
//   1. Payload: 16-byte stores of r's data into every destination's slot (e & 1), through peer
//      pointers (unicast) or one multimem.st to the multicast address (multicast).
//   2. Publish: every writing thread executes fence.sc.sys; the CTA synchronises; thread 0
//      increments a local arrival counter; the CTA that arrives last (the elected CTA) resets the
//      counter, executes fence.acq_rel.sys and st.release.sys the value (u32)e into
//      signals[slot][r] of every destination (or one multimem.st.release.sys).
//   3. Wait: the threads that need peer data poll signals[slot][s] with ld.acquire.sys until it
//      equals (u32)e, then the CTA synchronises before any thread reads the payload.
//   4. The elected CTA of the last kernel of the call stores e into epoch.
// Reuse is safe without any extra barrier: rank r writes slot p again only at epoch e + 2; its
// call e + 1 waited for every peer's e + 1 signal, and a peer publishes e + 1 only inside its
// call e + 1, which starts after its call e (and all its reads of slot p) retired on its stream.
// Waits test equality, never ordering, so the protocol is unaffected when the low 32 bits wrap.
// Every wait has a deadline (%globaltimer). On expiry the waiting thread records
// (op, rank, silent peer, expected, observed, ubatch) in host-mapped memory, sets the device
// abort word so that no later call of the workspace waits again, and the kernel returns; the host
// raises CollectiveTimeout at the next call or synchronize().
//
// Target architectures: everything but the multicast stores needs sm_70 (Volta) or newer:
// ld.acquire / st.release / ld.relaxed / st.relaxed, fence.sc / fence.acq_rel and
// atom.relaxed are PTX memory-model instructions of sm_70. bf16 conversion uses cvt.rn.bf16.f32
// on sm_80+ and the same rounding written out in integer arithmetic below it. The multimem
// stores exist only on sm_90+; on older targets they compile to a trap, so that every file
// (unicast variants included) still compiles in one NVRTC run for any target >= sm_70.
#pragma once

namespace dcpkit {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

// ----------------------------------------------------------------------------- element types
// Kernels never include cuda_fp16.h / cuda_bf16.h (NVRTC does not ship them everywhere); these
// 16-bit types are plain bit containers converted with cvt instructions.
struct bf16_t { u16 bits; };
struct fp16_t { u16 bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) {
  return __uint_as_float(static_cast<u32>(x.bits) << 16);
}
__device__ __forceinline__ float to_float(fp16_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  bf16_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
#else
  // sm_70 / sm_75 have no bf16 cvt: round to nearest, ties to even, on the bits (exact for
  // finite values, subnormals and infinities; a NaN stays a quiet NaN of the same sign).
  const u32 u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = static_cast<u16>((u >> 16) | 0x0040u);
  } else {
    r.bits = static_cast<u16>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
#endif
  return r;
}
template <> __device__ __forceinline__ fp16_t from_float<fp16_t>(float x) {
  fp16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}

// Elements of T in one 16-byte vector.
template <typename T> struct vec_elems { static constexpr int value = 16 / sizeof(T); };

// Unpack / pack a 16-byte vector of T into / from fp32.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& v, float* out) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < vec_elems<T>::value; ++i) out[i] = to_float(e[i]);
}
template <typename T>
__device__ __forceinline__ uint4 pack16(const float* in) {
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < vec_elems<T>::value; ++i) e[i] = from_float<T>(in[i]);
  return v;
}

// ----------------------------------------------------------------------------- memory ordering
// 16-byte global loads and stores (the payload). Loads of peer-written data happen only after a
// wait (acquire + CTA barrier); they bypass L1 (.cg) so no line cached earlier can be stale.
__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
// One float written by a peer (an lse value in a slot), read after a wait: bypass L1 like ld16.
__device__ __forceinline__ float ld_cg_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
// Read-only input data that no peer writes: the non-coherent path is fine.
__device__ __forceinline__ uint4 ld16_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st16(void* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 ld_relaxed_sys(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_sc_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ u32 atom_add_relaxed_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Multicast: one store whose copies land in every rank's memory (sm_90, NVLink SHARP). Used only
// where dcpkit's multicast guard allows it (dcpkit/multicast.py, NOTE [dcpkit multicast guard]):
// the Multicast variants are launched only with a multicast object bound, and one exists only on
// devices that report CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 1, i.e. sm_90 or newer. Below
// sm_90 these helpers compile to a trap (multimem.* does not exist there) so that the unicast
// variants of the same file still compile for sm_70 .. sm_89; a trap there means the guard was
// bypassed.
__device__ __forceinline__ void multimem_st16(void* mc, const uint4& v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};"
               :: "l"(mc), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void multimem_st_release_sys(u32* mc, u32 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("multimem.st.release.sys.global.u32 [%0], %1;" :: "l"(mc), "r"(v) : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

enum class Transport : int { Unicast = 0, Multicast = 1 };

// ----------------------------------------------------------------------------- protocol state
// Host-visible timeout record (mapped pinned memory), one per workspace. Layout shared with
// dcpkit/ops/_workspace.py (TIMEOUT_RECORD_FIELDS).
struct TimeoutRecord {
  u32 state;     // 0 = clear, 1 = being written, 2 = complete
  u32 op;        // op id (dcpkit/ops/_workspace.py OP_IDS)
  u32 rank;      // the rank that waited
  u32 peer;      // the silent peer
  u32 expected;  // low 32 bits of the epoch waited for
  u32 observed;  // the signal value last seen
  u32 ubatch;
  u32 pad;
};

// Everything the protocol needs, passed to every kernel as separate parameters and gathered here.
struct Proto {
  u64* epoch;           // this ubatch's epoch counter (device memory)
  u32* arrive;          // this ubatch's CTA arrival counter (device memory, zero between calls)
  u32* abort_word;      // workspace abort word (device memory)
  TimeoutRecord* rec;   // workspace timeout record (host-mapped)
  u32* signals;         // this rank's signals [2][world] of this ubatch (local copy)
  const u64* peer_sig;  // [world]: address of signals[0][0] of this ubatch on each peer
  u32* mc_sig;          // multicast address of signals[0][0] (0 without multicast)
  int rank;
  int world;
  u64 timeout_ns;
  u32 op;
  u32 ubatch;
};

// Kernel parameters of the protocol, first in every dcpkit kernel's parameter list (the order is
// the one dcpkit/ops/_workspace.py passes), and the Proto built from them.
#define DCPKIT_PROTO_PARAMS                                                               \
  dcpkit::u64 *proto_epoch, dcpkit::u32 *proto_arrive, dcpkit::u32 *proto_abort,          \
      dcpkit::TimeoutRecord *proto_rec, dcpkit::u32 *proto_signals,                       \
      const dcpkit::u64 *proto_peer_sig, dcpkit::u32 *proto_mc_sig, int proto_rank,       \
      int proto_world, dcpkit::u64 proto_timeout_ns, dcpkit::u32 proto_op,                \
      dcpkit::u32 proto_ubatch
#define DCPKIT_PROTO_MAKE()                                                               \
  dcpkit::Proto{proto_epoch, proto_arrive, proto_abort, proto_rec, proto_signals,         \
                proto_peer_sig, proto_mc_sig, proto_rank, proto_world, proto_timeout_ns,  \
                proto_op, proto_ubatch}

// The epoch of this call. Read it once, at kernel start, and keep it: the elected CTA stores the
// new value before the kernel ends. (every thread may call it; the value only changes between kernels).
__device__ __forceinline__ u64 call_epoch(const Proto& p) {
  return *reinterpret_cast<volatile u64*>(p.epoch) + 1ull;
}
__device__ __forceinline__ bool aborted(const Proto& p) {
  return *reinterpret_cast<volatile u32*>(p.abort_word) != 0u;
}

__device__ __forceinline__ void record_timeout(const Proto& p, int peer, u32 expected,
                                               u32 observed) {
  atomicExch(p.abort_word, 1u);
  if (atomicCAS(&p.rec->state, 0u, 1u) == 0u) {
    volatile TimeoutRecord* r = p.rec;
    r->op = p.op;
    r->rank = static_cast<u32>(p.rank);
    r->peer = static_cast<u32>(peer);
    r->expected = expected;
    r->observed = observed;
    r->ubatch = p.ubatch;
    __threadfence_system();
    st_release_sys(&p.rec->state, 2u);
  }
}

// Poll signals[slot][src] until it equals `expected` or the deadline passes. Returns false on
// timeout (after recording it) or when the workspace was aborted by another thread.
__device__ __forceinline__ bool wait_signal(const Proto& p, int slot, int src, u32 expected) {
  const u32* sig = p.signals + slot * p.world + src;
  u32 v = ld_acquire_sys(sig);
  if (v == expected) return true;
  const u64 start = globaltimer_ns();
  u32 spins = 0;
  while (true) {
    v = ld_acquire_sys(sig);
    if (v == expected) return true;
    if ((++spins & 255u) == 0u) {
      if (aborted(p)) return false;
      if (globaltimer_ns() - start > p.timeout_ns) {
        record_timeout(p, src, expected, v);
        return false;
      }
    }
  }
}

// Threads [0, world) of the calling CTA wait for one source each (src = threadIdx.x, this rank
// included: its own signal tells that every CTA of this rank's kernel finished its stores into
// the local slot); then the CTA synchronises. Returns false (uniformly across the CTA) when any
// wait failed. Must be called by every thread of the CTA (blockDim.x >= world).
__device__ __forceinline__ bool wait_all_sources(const Proto& p, int slot, u32 expected) {
  __shared__ int ok_all;
  if (threadIdx.x == 0) ok_all = 1;
  __syncthreads();
  const int src = static_cast<int>(threadIdx.x);
  if (src < p.world) {
    if (!wait_signal(p, slot, src, expected)) atomicExch(&ok_all, 0);
  }
  __syncthreads();
  return ok_all != 0;
}

// Publish step (2) of NOTE [dcpkit epoch signalling]. Called by every thread of every CTA after
// its payload stores; returns true in the elected (last) CTA. `publish` = false runs only the
// election (for kernels that must elect a last CTA without signalling).
template <Transport TR>
__device__ __forceinline__ bool arrive_and_publish(const Proto& p, u32 epoch32, int slot,
                                                   bool publish) {
  __shared__ int is_last;
  fence_sc_sys();
  __syncthreads();
  if (threadIdx.x == 0) {
    const u32 prev = atom_add_relaxed_gpu(p.arrive, 1u);
    is_last = (prev == gridDim.x - 1u) ? 1 : 0;
    if (is_last) {
      fence_acq_rel_sys();
      *reinterpret_cast<volatile u32*>(p.arrive) = 0u;  // ready for the next call
    }
  }
  __syncthreads();
  if (is_last && publish) {
    if (TR == Transport::Multicast) {
      if (threadIdx.x == 0) multimem_st_release_sys(p.mc_sig + slot * p.world + p.rank, epoch32);
    } else {
      const int peer = static_cast<int>(threadIdx.x);
      if (peer < p.world) {
        u32* dst = reinterpret_cast<u32*>(p.peer_sig[peer]) + slot * p.world + p.rank;
        st_release_sys(dst, epoch32);
      }
    }
  }
  return is_last != 0;
}

// Step (4): the elected CTA of the call's last kernel stores the new epoch.
__device__ __forceinline__ void finish_epoch(const Proto& p, u64 e) {
  if (threadIdx.x == 0) *reinterpret_cast<volatile u64*>(p.epoch) = e;
}

}  // namespace dcpkit
