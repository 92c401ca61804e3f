// dcpkit_ptx.cuh: every piece of inline PTX dcpkit uses, the element types, and the epoch
// signalling protocol shared by all ops. Kernels include this header and nothing else.
//
// NOTE [dcpkit epoch signalling]
// ------------------------------
// Every op workspace owns, per ubatch:
//   * epoch   : a 64-bit counter in ordinary device memory. A call reads it, uses e = epoch + 1,
//               and the elected CTA (below) stores e back. It is advanced on the device, inside
//               the op's own kernel, so CUDA-graph replays advance it too.
//   * signals : u64 [2][world_size] in symmetric memory. signals[slot][s] on rank r is written
//               only by rank s, slot = e & 1. A signal word is (fingerprint << 32) | (u32)e: the
//               low half is the epoch, the high half the fingerprint of the call (below).
//   * slots   : data regions multi-buffered by epoch.
// A call at epoch e on rank r, in a kernel of G CTAs of which K wait (1 <= K <= G):
//   1. Payload: every CTA stores its share of r's data into every destination's slot (16-byte
//      stores through peer pointers, or one multimem.st to the multicast address).
//   2. Arrive: CTA barrier (bar.sync); then thread 0 alone adds 1 to the ubatch's arrival
//      counter with atom.acq_rel.gpu. The CTA that gets G - 1 back is the elected CTA: it resets
//      the counter, stores e into epoch, executes ONE fence.acq_rel.sys and then, still in
//      thread 0, one st.relaxed.sys.u64 of the signal word into signals[slot][r] of every
//      destination (this rank included; or one multimem.st.relaxed.sys.u64). The CTAs that got
//      G - K .. G - 1 back (the last K to arrive, the elected one included) are the waiters; every
//      other CTA exits here.
//   3. Wait (waiters only): threads [0, world) each poll signals[slot][s] with ld.relaxed.sys
//      until its low half equals (u32)e, compare the polled word's fingerprint and issue one
//      ld.acquire.sys of the word (its value, the polled one, unused: acquire_polled); then the
//      CTA synchronises before any thread reads the payload.
//   4. Copy-out / combine: the waiters, and every other CTA that finds all the signals of
//      the call within a bounded spin (help_budget_ns; it never blocks), claim units of the work from
//      a per-call work counter (parity e & 1, reset for the next call by the elected CTA, or by
//      CTA 0 under share counters) until
//      none is left. The waiters alone guarantee completion; the helpers add parallelism.
// Why this is enough (PTX ISA, "Memory Consistency Model": morally strong operations,
// release and acquire patterns, causality order). A CTA's payload stores precede its bar.sync;
// the barrier orders them before thread 0's atom, whose release semantics (gpu scope, morally
// strong with every other CTA's atom on the same counter) make them precede, in causality order,
// everything after the elected CTA's acquire of the same counter (the atoms form one release
// sequence, each observes the previous one). The elected thread's fence.acq_rel.sys followed by
// its relaxed signal stores is a release pattern at system scope; a waiter's ld.acquire.sys that
// reads the signal value is an acquire pattern morally strong with it; the waiter's bar.sync
// then extends the order to every thread of its CTA. Causality order is transitive, so every
// payload store of every CTA of every source happens before every payload load of the waiters.
// No other fence is needed: no fence.sc and no per-thread fence on either side.
// Reuse is safe without any extra barrier: rank r writes slot p again only at epoch e + 2; its
// call e + 1 waited for every peer's e + 1 signal, and a peer publishes e + 1 only inside its
// call e + 1, which starts after its call e (and all its reads of slot p) retired on its stream.
// Waits test equality, never ordering, so the protocol is unaffected when the low 32 bits wrap.
//
// Fingerprint (the high half of a signal word; dcpkit/ops/_protocol.py mirrors the macros):
//   bits  0- 2  op id (1 lse_reduce, 2 q_gather, 3 kv_gather)
//   bits  3- 6  ubatch mod 16
//   bits  7-10  dtype code of the data (dcpkit/ops/_protocol.py DTYPE_CODES)
//   bits 11-12  lse_partial dtype code (lse_reduce; 0 for the gathers)
//   bit  13     query_start_loc given;  bit 14  seq_lens given (lse_reduce)
//   bits 15-30  T mod 2**16
//   bit  31     the push gathers: result stored straight into a graph output buffer (NOTE
//               [dcpkit zero-copy graph outputs] in gather.cuh)
// A waiter that reads the expected epoch with another fingerprint stops waiting, records op,
// rank, peer, its own fingerprint and the fingerprint it saw from every source of this epoch in
// the host-mapped record (kind = mismatch), and poisons the workspace; the host raises
// ConfigMismatch naming the ranks and values. T values that differ by a multiple of 2**16, and
// anything the fingerprint does not carry, are left to the host check of DCPKIT_DEBUG=1. A
// ubatch mismatch sends the signal to another ubatch's words: a waiter whose deadline expires
// first looks there (a peer's signal for an epoch this rank did not call on that ubatch) and
// records a mismatch instead of a timeout. With -DDCPKIT_SELF_CHECK=0 (benchmark only) the waits
// compare the epoch only.
//
// The push gathers and lse_reduce replace steps 2 and 3 (arrival, election, one signal per rank)
// with a publish by every CTA into per-source share counters: NOTE [dcpkit share counters]
// below. Their signal words still carry the fingerprint, and everything else here holds for them
// too. Only the pull kv_gather elects.
//
// Co-residency rule (no deadlock whatever the launch order). Only waiter CTAs ever block, and a
// kernel has at most K of them; every other CTA stores, arrives, spins at most kHelpMaxNs, maybe
// helps (bounded work, no wait) and exits in bounded time. The
// host keeps K <= waiter_ctas = max(1, SM share // MAX_LIVE_KERNELS) (SM share: this rank's
// part of the SMs when ranks share the GPU, dcpkit/_sm_share.py; MAX_LIVE_KERNELS = 8 dcpkit kernels of one rank in flight at once, e.g. four
// workspaces x two ubatches), and every kernel's launch bounds let two of its CTAs fit on one
// SM. So the waiters of all dcpkit kernels in flight on a GPU never exceed its SM count, the GPU
// has room for one more dcpkit CTA than its waiters take, and a CTA that does not wait can
// always be scheduled once foreign kernels (which never wait on dcpkit) retire: every kernel's
// elected CTA arrives, every signal is stored, every waiter returns. A long compute kernel
// delays calls, never deadlocks them. Zero-copy gathers use K = 1 (kernel completion only has
// to imply the data). A zero-copy graph call (NOTE [dcpkit zero-copy graph outputs] in
// gather.cuh) is the exception: all its CTAs wait for the peers' credits before they store, so
// the host caps its grid at half the SM share, and it counts as that many waiters (four of the
// MAX_LIVE_KERNELS kernels' worth). More than MAX_LIVE_KERNELS kernels of a rank in flight, or a
// larger waiter_ctas, void this argument (the knob is for measurements).
//
// Every wait has a deadline (%globaltimer). On expiry the waiting thread records (op, rank,
// silent peer, expected, observed, ubatch) in host-mapped memory, sets the device abort word so
// that no later kernel of the workspace waits again, and returns. A poisoned workspace stays
// visibly poisoned: in the call whose wait failed, and in every later kernel of the workspace
// (eager or graph replay), the elected CTA fills the call's whole result with 0xFF bytes (NaN in
// every float dtype, merged lse NaN). A CTA that finds the workspace poisoned at its start stores
// nothing but still arrives (its arrival says so), and the elected CTA stores no signal when any
// CTA of its kernel stored nothing: so the elected CTA is always the last of the kernel to
// store, no signal ever announces partial data, and no stale or partial data is left in the
// result. A call whose CTAs all stored their payload signals even if a waiter of the same call
// poisoned the workspace meanwhile (a mismatch it saw): the peers then see the fingerprint and
// report the mismatch themselves instead of timing out. (Under share counters a CTA that stored
// nothing adds a skip to this rank's own counter instead, and the waiters poison only once that
// counter has reached the call: NOTE [dcpkit share counters].) The host raises CollectiveTimeout /
// ConfigMismatch at the next call, synchronize() or check().
//
// Target architectures: everything but the multicast stores needs sm_70 (Volta) or newer:
// ld.acquire / st.release / ld.relaxed / st.relaxed, fence.acq_rel and atom.acq_rel are PTX
// memory-model instructions of sm_70. bf16 conversion uses cvt.rn.bf16.f32
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
// ld16_nc / ld16 for data a call reads exactly once (an op's input, slot rows at their last use):
// the lines are marked evict-first in the L2 (sm_80+; plain loads below that), so that the data
// still to be read in the call (slot rows written by the peers) stays there instead.
__device__ __forceinline__ u64 l2_evict_first() {
  u64 pol = 0ull;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#endif
  return pol;
}
__device__ __forceinline__ uint4 ld16_nc_once(const void* p, u64 pol) {
  uint4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
#else
  (void)pol;
  v = ld16_nc(p);
#endif
  return v;
}
__device__ __forceinline__ uint4 ld16_once(const void* p, u64 pol) {
  uint4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ld.global.cg.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol) : "memory");
#else
  (void)pol;
  v = ld16(p);
#endif
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
// 64-bit signal words (NOTE [dcpkit epoch signalling]).
__device__ __forceinline__ u64 ld_relaxed_sys_u64(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_acquire_sys_u64(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// The acquire that follows a relaxed poll of a signal or credit word, once the poll has seen the
// awaited epoch. The caller uses the polled word, the one that matched (fingerprint, credit
// offset), and not the acquire's value: for a signal word the two are the same (NOTE [dcpkit
// epoch signalling]: the next store into it is for epoch e + 2), while a credit word can already
// hold the peer's next call's credit by the time the acquire reads it (a peer whose call failed
// does not wait for this rank), so the polled word is the right one there. The acquire still
// orders every later load after the poll; with its value unused, ptxas emits that ordering alone
// (the L1 invalidation after the poll's load, whose value the caller has already waited for)
// instead of a second round trip to the word.
// Measured: reading the fingerprint from the acquire's value cost that round trip, 0.2-0.4 us
// per call at T <= 8 (docs/performance.md); tests/unit/test_protocol_cpu.py keeps the acquire's
// value unused.
__device__ __forceinline__ void acquire_polled(const u64* p) { (void)ld_acquire_sys_u64(p); }
__device__ __forceinline__ void st_relaxed_sys_u64(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys_u64(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
// The arrival counter of the CTA election: release (this CTA's stores, ordered before it by the
// CTA barrier) and acquire (every earlier arrival's) at gpu scope.
__device__ __forceinline__ u32 atom_add_acq_rel_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
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
__device__ __forceinline__ void multimem_st_relaxed_sys_u64(u64* mc, u64 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("multimem.st.relaxed.sys.global.u64 [%0], %1;" :: "l"(mc), "l"(v) : "memory");
#else
  __trap();
#endif
}

// A 64-bit add whose result is not returned (no round trip): the share counters of the push
// gathers (NOTE [dcpkit share counters]).
__device__ __forceinline__ void red_relaxed_sys_add_u64(u64* p, u64 v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void multimem_red_relaxed_sys_add_u64(u64* mc, u64 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("multimem.red.relaxed.sys.global.add.u64 [%0], %1;" :: "l"(mc), "l"(v) : "memory");
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

// ----------------------------------------------------------------------------- timeline
// Diagnostics only, compiled in with -DDCPKIT_TIMELINE=1 (scripts/kernel_timeline.py; never in
// the kernels the ops ship): thread 0 of every CTA stores the time of the phase marks of a call,
// %globaltimer (ns, one clock for every process on the GPU) in words [0, kTimelineMarks) and
// clock64 (SM cycles) in words [kTimelineMarks, 2 * kTimelineMarks), into
// dcpkit_timeline[call % kTimelineCalls][blockIdx.x], a buffer the host sets per module (null:
// nothing stored). Marks: 0 entry, 1 poison check done, 2 payload stores issued, 3 arrival /
// publish done, 4 every signal seen, 5 exit; word kTimelineRole holds the CTA's role (waiter
// index + 1, 0 for a CTA that did not wait), kTimelineSm its SM.
#ifndef DCPKIT_TIMELINE
#define DCPKIT_TIMELINE 0
#endif
#if DCPKIT_TIMELINE
constexpr unsigned kTimelineCalls = 64;
constexpr unsigned kTimelineCtas = 512;
constexpr unsigned kTimelineMarks = 8;
constexpr unsigned kTimelineRole = 6;
constexpr unsigned kTimelineSm = 7;
}  // namespace dcpkit
extern "C" {
__device__ unsigned long long* dcpkit_timeline;
}
namespace dcpkit {
struct TimelineMark {
  u64 ns, cycles;
};
__device__ __forceinline__ TimelineMark timeline_now() {
  return TimelineMark{globaltimer_ns(), static_cast<u64>(clock64())};
}
// This CTA's row for `call`, or null where nothing is stored (not thread 0, no buffer set, a
// CTA past the buffer).
__device__ __forceinline__ u64* timeline_row(u64 call) {
  u64* buf = dcpkit_timeline;
  if (threadIdx.x != 0 || buf == nullptr || blockIdx.x >= kTimelineCtas) return nullptr;
  return buf + ((call % kTimelineCalls) * kTimelineCtas + blockIdx.x) * (2 * kTimelineMarks);
}
__device__ __forceinline__ void timeline_put(u64 call, unsigned mark, TimelineMark t) {
  u64* row = timeline_row(call);
  if (row == nullptr) return;
  if (mark == 0u) {  // a new call in this row: clear what an older call left
    for (unsigned i = 1; i < 2 * kTimelineMarks; ++i) row[i] = 0ull;
  }
  row[mark] = t.ns;
  row[kTimelineMarks + mark] = t.cycles;
}
__device__ __forceinline__ void timeline_role(u64 call, u64 role) {
  u64* row = timeline_row(call);
  if (row == nullptr) return;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  row[kTimelineRole] = role;
  row[kTimelineSm] = sm;
}
#define DCPKIT_MARK_START() const dcpkit::TimelineMark dcpkit_tl_start = dcpkit::timeline_now()
#define DCPKIT_MARK_ENTRY(call) dcpkit::timeline_put((call), 0u, dcpkit_tl_start)
#define DCPKIT_MARK(call, mark) dcpkit::timeline_put((call), (mark), dcpkit::timeline_now())
#define DCPKIT_MARK_ROLE(call, role) dcpkit::timeline_role((call), (role))
#else
#define DCPKIT_MARK_START() ((void)0)
#define DCPKIT_MARK_ENTRY(call) ((void)0)
#define DCPKIT_MARK(call, mark) ((void)0)
#define DCPKIT_MARK_ROLE(call, role) ((void)0)
#endif

// ----------------------------------------------------------------------------- protocol state
// Fingerprint fields (NOTE [dcpkit epoch signalling]); dcpkit/ops/_protocol.py mirrors them.
#define DCPKIT_FP_OP_SHIFT 0
#define DCPKIT_FP_OP_BITS 3
#define DCPKIT_FP_UBATCH_SHIFT 3
#define DCPKIT_FP_UBATCH_BITS 4
#define DCPKIT_FP_DTYPE_SHIFT 7
#define DCPKIT_FP_DTYPE_BITS 4
#define DCPKIT_FP_LSE_SHIFT 11
#define DCPKIT_FP_LSE_BITS 2
#define DCPKIT_FP_QSL_SHIFT 13
#define DCPKIT_FP_SEQ_SHIFT 14
#define DCPKIT_FP_T_SHIFT 15
#define DCPKIT_FP_T_BITS 16
// A push gather whose result goes straight into a graph output buffer (NOTE [dcpkit zero-copy
// graph outputs] in gather.cuh).
#define DCPKIT_FP_ZC_SHIFT 31
// Record kinds; sources whose fingerprint the record keeps.
#define DCPKIT_REC_TIMEOUT 0
#define DCPKIT_REC_MISMATCH 1
#define DCPKIT_REC_SOURCES 64
#ifndef DCPKIT_SELF_CHECK
#define DCPKIT_SELF_CHECK 1
#endif

// Host-visible record of the first failure of a workspace (mapped pinned memory). Layout shared
// with dcpkit/ops/_protocol.py (RECORD_FIELDS, RECORD_WORDS).
struct ProtoRecord {
  u32 state;     // 0 = clear, 1 = being written, 2 = complete
  u32 op;        // op id (dcpkit/ops/_workspace.py OP_IDS)
  u32 rank;      // the rank that waited
  u32 peer;      // the silent (timeout) or disagreeing (mismatch) peer
  u32 expected;  // low 32 bits of the epoch waited for
  u32 observed;  // the signal's epoch half last seen
  u32 ubatch;
  u32 kind;      // DCPKIT_REC_TIMEOUT or DCPKIT_REC_MISMATCH
  u32 own_fp;    // fingerprint of this rank's call
  u32 peer_fp;   // fingerprint seen from `peer`
  u32 world;
  u32 reserved[5];
  u32 seen_fp[DCPKIT_REC_SOURCES];  // mismatch: fingerprint seen from each source at this epoch
                                    // (0 = not arrived when the record was written)
};
typedef ProtoRecord TimeoutRecord;  // the former name

// Everything the protocol needs, passed to every kernel as separate parameters and gathered here.
struct Proto {
  u64* epoch;           // this ubatch's epoch counter (device memory; u64 [num_ubatches])
  u32* arrive;          // this ubatch's CTA arrival counter (device memory, zero between calls)
  u32* abort_word;      // workspace abort word (device memory)
  ProtoRecord* rec;     // workspace record (host-mapped)
  u64* signals;         // this rank's signals [2][world] of this ubatch (local copy)
  const u64* peer_sig;  // [world]: address of signals[0][0] of this ubatch on each peer
  u64* mc_sig;          // multicast address of signals[0][0] (0 without multicast)
  int rank;
  int world;
  u64 timeout_ns;
  u32 op;
  u32 ubatch;
  u32 fp_base;          // op, ubatch and dtype fields of the fingerprint
  u32 waiters;          // most waiter CTAs of a copy-out / combine kernel (host: waiter_ctas)
  u32 num_ubatches;
  u32 sig_ustride;      // u64 words between the signals of consecutive ubatches
  u32* work;            // this ubatch's work counters [2] (by epoch parity; device memory)
};

// NOTE [dcpkit programmatic launch]
// ---------------------------------
// An op built with programmatic_launch=True (dcpkit/ops/_workspace.py) compiles its kernels with
// DCPKIT_PDL=1 and launches them with cuLaunchKernelEx and the programmatic stream serialization
// attribute: the kernel may start while the kernel before it on the stream is still finishing,
// so its launch overlaps that kernel's tail. Every op kernel makes its Proto first thing, and
// DCPKIT_PROTO_MAKE() then waits (griddepcontrol.wait) until the kernel before it has completed
// and its memory is visible: nothing of this call -- its input, its epoch, its abort word, the
// signals, a credit -- is read or written before that, so the call sees exactly what it would
// see after a plain launch (the credit's "the kernels before it have finished" included). The
// op's kernels never call griddepcontrol.launch_dependents: a kernel after them starts only as
// their CTAs exit. Before them, a kernel that triggers its dependents early (the point of the
// option) lets every CTA of the op's grid become resident and block in the wait, not only its
// waiters: the co-residency rule of NOTE [dcpkit epoch signalling] then also needs that kernel
// to finish without waiting for other work that needs SMs (a kernel that, after triggering,
// waits for another rank's kernel on the same GPU could be starved). The host cannot check
// that: it is the caller's half of the opt-in (README). Without DCPKIT_PDL the wait is not
// compiled (the shipped kernels are unchanged); below sm_90 there is no such instruction: the
// build refuses DCPKIT_PDL there and the host refuses the option.
#if defined(DCPKIT_PDL) && DCPKIT_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "DCPKIT_PDL (programmatic launch) needs sm_90 or newer: the wait would compile away"
#endif
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(DCPKIT_PDL) && DCPKIT_PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Kernel parameters of the protocol, first in every dcpkit kernel's parameter list (the order is
// the one dcpkit/ops/_workspace.py passes), and the Proto built from them.
#define DCPKIT_PROTO_PARAMS                                                               \
  dcpkit::u64 *proto_epoch, dcpkit::u32 *proto_arrive, dcpkit::u32 *proto_abort,          \
      dcpkit::ProtoRecord *proto_rec, dcpkit::u64 *proto_signals,                         \
      const dcpkit::u64 *proto_peer_sig, dcpkit::u64 *proto_mc_sig, int proto_rank,       \
      int proto_world, dcpkit::u64 proto_timeout_ns, dcpkit::u32 proto_op,                \
      dcpkit::u32 proto_ubatch, dcpkit::u32 proto_fp_base, dcpkit::u32 proto_waiters,     \
      dcpkit::u32 proto_num_ubatches, dcpkit::u32 proto_sig_ustride, dcpkit::u32 *proto_work
#define DCPKIT_PROTO_MAKE()                                                               \
  (dcpkit::grid_dependency_wait(),                                                        \
   dcpkit::Proto{proto_epoch, proto_arrive, proto_abort, proto_rec, proto_signals,        \
                 proto_peer_sig, proto_mc_sig, proto_rank, proto_world, proto_timeout_ns, \
                 proto_op, proto_ubatch, proto_fp_base, proto_waiters, proto_num_ubatches,\
                 proto_sig_ustride, proto_work})

// The fingerprint of this call: the workspace's fields plus T, the lse dtype code and the masks.
__device__ __forceinline__ u32 call_fingerprint(const Proto& p, u32 T, u32 lse_code, bool qsl,
                                                bool seq) {
  return p.fp_base | (lse_code << DCPKIT_FP_LSE_SHIFT) |
         ((qsl ? 1u : 0u) << DCPKIT_FP_QSL_SHIFT) | ((seq ? 1u : 0u) << DCPKIT_FP_SEQ_SHIFT) |
         ((T & ((1u << DCPKIT_FP_T_BITS) - 1u)) << DCPKIT_FP_T_SHIFT);
}
__device__ __forceinline__ u64 signal_word(u64 e, u32 fp) {
  return (static_cast<u64>(fp) << 32) | static_cast<u64>(static_cast<u32>(e));
}

// The epoch of this call. Read it once, at kernel start, and keep it: the elected CTA stores the
// new value before the kernel ends (every thread may call it; it changes only between kernels:
// the elected CTA is the last to arrive, or, under share counters, stores it only once this
// rank's own counter says every CTA of the kernel has read it).
__device__ __forceinline__ u64 call_epoch(const Proto& p) {
  return *reinterpret_cast<volatile u64*>(p.epoch) + 1ull;
}
__device__ __forceinline__ bool aborted(const Proto& p) {
  return *reinterpret_cast<volatile u32*>(p.abort_word) != 0u;
}

// Write the record (first failure of the workspace only) and poison the workspace. For a
// mismatch, the fingerprint seen from every source of this epoch goes in too, so that the host
// can name every rank's value; `peer_word` is the word seen from `peer` (it may come from
// another ubatch's signals).
__device__ __forceinline__ void record_failure(const Proto& p, u32 kind, int slot, int peer,
                                               u32 expected, u64 peer_word, u32 own_fp) {
  atomicExch(p.abort_word, 1u);
  if (atomicCAS(&p.rec->state, 0u, 1u) == 0u) {
    volatile ProtoRecord* r = p.rec;
    r->op = p.op;
    r->rank = static_cast<u32>(p.rank);
    r->peer = static_cast<u32>(peer);
    r->expected = expected;
    r->observed = static_cast<u32>(peer_word);
    r->ubatch = p.ubatch;
    r->kind = kind;
    r->own_fp = own_fp;
    r->peer_fp = static_cast<u32>(peer_word >> 32);
    r->world = static_cast<u32>(p.world);
    if (kind == DCPKIT_REC_MISMATCH) {
      for (int s = 0; s < p.world && s < DCPKIT_REC_SOURCES; ++s) {
        const u64 w = ld_relaxed_sys_u64(p.signals + slot * p.world + s);
        r->seen_fp[s] = (static_cast<u32>(w) == expected) ? static_cast<u32>(w >> 32) : 0u;
      }
      if (peer < DCPKIT_REC_SOURCES) r->seen_fp[peer] = static_cast<u32>(peer_word >> 32);
    }
    __threadfence_system();
    st_release_sys(&p.rec->state, 2u);
  }
}

__device__ __forceinline__ u64 share_counter_off(const Proto& p, int src);
__device__ __forceinline__ bool shares_reached(u64 v, u64 e);

// At the deadline: did `src` signal another ubatch of this workspace for an epoch this rank has
// not called there (a ubatch mismatch)? Returns that signal word, or 0. `shares`: the caller's
// kernel publishes by share counters (NOTE [dcpkit share counters]).
__device__ __forceinline__ u64 other_ubatch_signal(const Proto& p, int src, bool shares) {
  const u64* epochs = p.epoch - p.ubatch;
  const u64* sig0 = p.signals - static_cast<u64>(p.ubatch) * p.sig_ustride;
  for (u32 u = 0; u < p.num_ubatches; ++u) {
    if (u == p.ubatch) continue;
    const u64 e = *reinterpret_cast<const volatile u64*>(epochs + u) + 1ull;
    const u64* sig_u = sig0 + u * p.sig_ustride;
    const u64 w = ld_relaxed_sys_u64(sig_u + (e & 1ull) * p.world + src);
    if (static_cast<u32>(w) != static_cast<u32>(e) || (w >> 32) == 0ull) continue;
    // Under share counters the epoch is stored after the waits: a call of ubatch u that this
    // rank has made and published, still waiting there, is not a mismatch. (The election
    // stores the epoch at arrival, and its kernels leave the counters alone.)
    if (shares && shares_reached(ld_relaxed_sys_u64(sig_u + share_counter_off(p, p.rank)), e)) {
      continue;
    }
    return w;
  }
  return 0ull;
}

// Poll signals[slot][src] until its epoch half equals `expected`, then one acquire and the
// fingerprint check. Returns false on timeout or mismatch (after recording it) or when the
// workspace was poisoned by another thread.
__device__ __forceinline__ bool wait_signal(const Proto& p, int slot, int src, u32 expected,
                                            u32 fp) {
  const u64* sig = p.signals + slot * p.world + src;
  u64 v = ld_relaxed_sys_u64(sig);
  if (static_cast<u32>(v) != expected) {
    const u64 start = globaltimer_ns();
    u32 spins = 0;
    while (true) {
      v = ld_relaxed_sys_u64(sig);
      if (static_cast<u32>(v) == expected) break;
      if ((++spins & 255u) == 0u) {
        if (aborted(p)) return false;
        if (globaltimer_ns() - start > p.timeout_ns) {
          const u64 other = other_ubatch_signal(p, src, false);
          if (other != 0ull) {
            record_failure(p, DCPKIT_REC_MISMATCH, slot, src, expected, other, fp);
          } else {
            record_failure(p, DCPKIT_REC_TIMEOUT, slot, src, expected, v, fp);
          }
          return false;
        }
      }
    }
  }
  acquire_polled(sig);  // the one acquire of this source; the check reads the polled word
#if DCPKIT_SELF_CHECK
  if (static_cast<u32>(v >> 32) != fp) {
    record_failure(p, DCPKIT_REC_MISMATCH, slot, src, expected, v, fp);
    return false;
  }
#endif
  return true;
}

// Threads [0, world) of the calling CTA wait for one source each (src = threadIdx.x, this rank
// included: its own signal tells that every CTA of this rank's kernel finished its stores into
// the local slot); then the CTA synchronises. Returns false (uniformly across the CTA) when any
// wait failed. Must be called by every thread of the CTA (blockDim.x >= world).
__device__ __forceinline__ bool wait_all_sources(const Proto& p, int slot, u32 expected, u32 fp) {
  const int src = static_cast<int>(threadIdx.x);
  int ok = 1;
  if (src < p.world) ok = wait_signal(p, slot, src, expected, fp) ? 1 : 0;
  return __syncthreads_and(ok) != 0;
}

// Steps 2 (arrive, elect, publish) of NOTE [dcpkit epoch signalling]. Called by every thread of
// every CTA after its payload stores (also by a CTA that found the workspace poisoned and stored
// nothing: every CTA arrives, so that the elected one comes after all of them). Returns this
// CTA's waiter index in [0, K) if it is one of the last K CTAs to arrive, else -1 (the CTA must
// exit without waiting). K = min(gridDim.x, k_waiters), k_waiters >= 1; the elected CTA is
// waiter K - 1. `skipped`: this CTA stored nothing (it found the workspace poisoned when it
// started). The elected CTA publishes only when no CTA of the kernel skipped: a CTA that starts
// after a waiter of this very call recorded a mismatch stores nothing, and a signal then would
// announce partial data; with every payload stored, the signal goes out even though the
// workspace was poisoned meanwhile, so that the peers see the fingerprint and report the
// mismatch too (instead of timing out). Arrivals add 1, plus kSkipArrival for a CTA that
// skipped (grids stay below kSkipArrival CTAs). `published` (meaningful in the elected CTA
// only): false when the elected CTA stored no signal.
// Destinations whose signal address arrive_and_publish reads before the arrival.
constexpr int kSigPrefetch = 8;
constexpr u32 kSkipArrival = 1u << 16;
template <Transport TR>
__device__ __forceinline__ int arrive_and_publish(const Proto& p, u64 e, int slot, u32 fp,
                                                  u32 k_waiters, bool skipped, bool& published) {
  __shared__ int s_waiter;
  __shared__ int s_published;
  __syncthreads();  // every thread's payload stores are ordered before thread 0's release
  if (threadIdx.x == 0) {
    const u32 n = gridDim.x;
    const u32 k = k_waiters < n ? k_waiters : n;
    // The signal addresses of the first kSigPrefetch destinations (peers first, this rank last),
    // read from the constant peer table before the arrival so that their latency overlaps the
    // atom's round trip instead of following the fence (plain loads of a table no one writes
    // during the call: no ordering is involved). Every CTA's thread 0 reads them; only the
    // elected one uses them.
    u64 sig_pre[kSigPrefetch];
    int d_pre = p.rank;
#pragma unroll
    for (int j = 0; j < kSigPrefetch; ++j) {
      sig_pre[j] = 0ull;
      if (TR == Transport::Unicast && j < p.world) {
        d_pre = (d_pre + 1 == p.world) ? 0 : d_pre + 1;
        sig_pre[j] = p.peer_sig[d_pre];
      }
    }
    const u32 prev_word = atom_add_acq_rel_gpu(p.arrive, skipped ? 1u + kSkipArrival : 1u);
    const u32 prev = prev_word & (kSkipArrival - 1u);   // CTAs arrived before this one
    const bool any_skipped = skipped || prev_word >= kSkipArrival;
    s_published = 0;
    if (prev == n - 1u) {
      // The work counter of the next call (parity e + 1): the call before this one, its last
      // user, retired before this kernel started.
      reinterpret_cast<volatile u32*>(p.work)[(e + 1ull) & 1ull] = 0u;
    }
    if (prev == n - 1u && any_skipped) {  // elected, some CTA stored nothing: no signal
      *reinterpret_cast<volatile u32*>(p.arrive) = 0u;
    } else if (prev == n - 1u) {  // elected: every CTA of this kernel has arrived
      s_published = 1;
      *reinterpret_cast<volatile u32*>(p.arrive) = 0u;  // ready for the next call
      *reinterpret_cast<volatile u64*>(p.epoch) = e;    // step (4): the new epoch
      fence_acq_rel_sys();                              // the one release of the call
      const u64 word = signal_word(e, fp);
      if (TR == Transport::Multicast) {
        multimem_st_relaxed_sys_u64(p.mc_sig + slot * p.world + p.rank, word);
      } else {
        // Peers first (rank + 1, rank + 2, ... wrapping), this rank last; no division. The
        // first kSigPrefetch addresses were read before the arrival.
#pragma unroll
        for (int j = 0; j < kSigPrefetch; ++j) {
          if (j < p.world) {
            st_relaxed_sys_u64(reinterpret_cast<u64*>(sig_pre[j]) + slot * p.world + p.rank,
                               word);
          }
        }
        int d = d_pre;
        for (int j = kSigPrefetch; j < p.world; ++j) {
          d = (d + 1 == p.world) ? 0 : d + 1;
          u64* dst = reinterpret_cast<u64*>(p.peer_sig[d]) + slot * p.world + p.rank;
          st_relaxed_sys_u64(dst, word);
        }
      }
    }
    s_waiter = (prev + k >= n) ? static_cast<int>(prev - (n - k)) : -1;
  }
  __syncthreads();
  published = s_published != 0;
  return s_waiter;
}

// Helping (step 4 of NOTE [dcpkit epoch signalling]): a CTA that is not a waiter polls every
// source's signal for a bounded time (it never blocks, so the co-residency rule is unaffected);
// if all are there with the right fingerprint it takes one acquire each and helps with the
// copy-out / combine. CTA-uniform; records nothing (the waiters do).
// The bound is what helping can save: kHelpNs, plus kHelpNsPerUnit for every unit of work the K
// waiters would do alone (`units` / K each), at most kHelpMaxNs. A small call gives up after
// about kHelpNs (waiting longer than the waiters' whole copy gains nothing); a large one waits
// out the usual skew between ranks (tens of microseconds, more on a shared GPU), so that the
// whole grid shares the work instead of K CTAs alone. The spin also ends as soon as the call's
// work counter shows every unit claimed (nothing left to help with).
constexpr u64 kHelpNs = 20000;
constexpr u64 kHelpNsPerUnit = 1000;
constexpr u64 kHelpMaxNs = 400000;
__device__ __forceinline__ u64 help_budget_ns(u32 units, u32 k_waiters) {
  const u64 k = k_waiters < gridDim.x ? k_waiters : gridDim.x;
  const u64 b = kHelpNs + kHelpNsPerUnit * (static_cast<u64>(units) / (k > 0ull ? k : 1ull));
  return b < kHelpMaxNs ? b : kHelpMaxNs;
}
__device__ __forceinline__ bool try_all_sources(const Proto& p, int slot, u32 expected, u32 fp,
                                                u32 units) {
  int ok = 1;
  const int src = static_cast<int>(threadIdx.x);
  if (src < p.world) {
    const u64* sig = p.signals + slot * p.world + src;
    u64 v = ld_relaxed_sys_u64(sig);
    if (static_cast<u32>(v) != expected) {
      const u64 budget = help_budget_ns(units, p.waiters);
      const volatile u32* work = p.work + slot;
      const u64 start = globaltimer_ns();
      u32 spins = 0;
      do {
        v = ld_relaxed_sys_u64(sig);
        if ((++spins & 63u) == 0u && *work >= units) break;  // every unit already claimed
      } while (static_cast<u32>(v) != expected && globaltimer_ns() - start < budget);
    }
    ok = static_cast<u32>(v) == expected ? 1 : 0;
    if (ok) {
      acquire_polled(sig);
      ok = (!DCPKIT_SELF_CHECK || static_cast<u32>(v >> 32) == fp) && !aborted(p) ? 1 : 0;
    }
  }
  return __syncthreads_and(ok) != 0;
}

// The next unit of work of this call (work counter of parity `slot`), for the whole CTA.
__device__ __forceinline__ u32 claim_work(const Proto& p, int slot) {
  __shared__ u32 s_claim;
  __syncthreads();  // every thread has read the previous claim
  if (threadIdx.x == 0) s_claim = atomicAdd(p.work + slot, 1u);
  __syncthreads();
  return s_claim;
}
// The same claim in two halves, so that the atomic's round trip overlaps the work of the unit in
// hand: claim_issue (thread 0 takes the next unit; its value is not waited for yet), then, after
// the unit in hand, claim_publish hands that value to the whole CTA. A CTA processes every unit it
// claims (the loop runs while the claim is < the unit count), so no unit is lost.
//   for (u32 c = claim_work(p, slot); c < units;) {
//     const u32 next = claim_issue(p, slot);
//     ... unit c ...
//     c = claim_publish(next);
//   }
__device__ __forceinline__ u32 claim_issue(const Proto& p, int slot) {
  return threadIdx.x == 0 ? atomicAdd(p.work + slot, 1u) : 0u;
}
__device__ __forceinline__ u32 claim_publish(u32 mine) {
  __shared__ u32 s_next;
  __syncthreads();  // every thread has read the previous claim
  if (threadIdx.x == 0) s_next = mine;
  __syncthreads();
  return s_next;
}

// NOTE [dcpkit share counters]
// ----------------------------
// The push gathers (gather_push_call in gather.cuh) and lse_reduce (lse_reduce.cu) publish
// without the election of step 2:
// on one H200 shared by the ranks the arrival atomic's round trip before the fence cost 0.35-0.55
// us per call at W=2 and up to 0.8 us at W=4 (scripts/protocol_probe.py, docs/performance.md).
// Instead every CTA publishes its own part:
//   * every ubatch keeps counters u64 [world] right after its credits; counters[s] on rank r
//     is added to only by the CTAs of rank s, and only ever grows;
//   * every CTA owns a share of kShareUnit (cta_share: the shares of a grid sum to kShareUnit,
//     whatever its size, so ranks may use different grids for the same call, e.g. out= on one
//     rank and the view form on another);
//   * after its payload stores and a CTA barrier, thread 0 of every CTA executes one
//     fence.acq_rel.sys and one red.relaxed.sys.add.u64 of its share into counters[rank] of
//     every destination, this rank last (or one multimem.red); thread 0 of CTA 0 first stores
//     the signal word (fingerprint << 32 | e) into signals[e & 1][rank] of every destination,
//     before its fence;
//   * a waiter thread polls counters[s] with ld.relaxed.sys until its share sum has reached
//     e * kShareUnit (shares_reached: a wrap-safe signed difference; waits test "reached"),
//     issues one ld.acquire.sys of it (acquire_polled), and requires signals[e & 1][s] to hold
//     exactly the signal word of this call (the fingerprint check).
// Why this is enough: each CTA's fence followed by its red is a release pattern at system scope;
// the reds on one counter are morally strong atomic operations, so the waiter's acquire that
// reads a value at or past e * kShareUnit observes, through the chain of reds before it in the
// counter's order, every CTA whose red came before (PTX ISA, "Memory Consistency Model":
// observation order through atomic read-modify-writes, release and acquire patterns). A source
// reaches e * kShareUnit only when every CTA of each of its calls up to e has added its share:
// a call starts after the one before it retired on its stream, and a CTA that stores nothing
// (the workspace poisoned at its start, or a failed credit wait) adds nothing to the peers'
// counters; the workspace is then poisoned for good, so every later call of that rank stores
// and adds nothing either, and no later share can stand in for the missing one. The signal
// word of CTA 0 precedes CTA 0's fence, so it is visible to the waiter, and it still holds call
// e (the next store into it is for call e + 2: the two-slot argument of NOTE [dcpkit epoch
// signalling]). This rank's own counter tells a waiter that every CTA of its kernel has passed
// its start (the epoch read) and its stores: the elected waiter stores the new epoch only after
// it. A CTA that stored nothing adds its share and a skip (below) to its own rank's counter only;
// a waiter or helper that sees a skip in its own counter's polled value treats the call as
// failed (the elected waiter fills the result), as a missing signal did before. The waiter reads
// the signal word beside each poll of the counter: a value equal to this call's word needs no
// second load; any other is read again after the acquire before it counts as a mismatch. The
// waiters are the last min(K, grid) CTAs by index: only their number matters to the
// co-residency rule, not the order in which CTAs arrive.
//
// A failed call never shows stale data as valid, and never sends any. A wait can fail early
// (another source's deadline, or the workspace poisoned meanwhile by another thread) while CTAs
// of this rank's kernel still store or have not started: after a failed wait the waiter waits
// for this rank's own counter all the same (settle_own_shares), so the epoch is stored, and the
// result poisoned, only once every CTA of the kernel has read the epoch and its inputs (an
// lse_reduce called in place reads its input, which the poison overwrites). A helper writes the
// result only after it saw every source's counter at the call with the right fingerprint.
// The call is recorded as failed either way (the next call raises).
constexpr int kShareShift = 20;
constexpr u64 kShareUnit = 1ull << kShareShift;  // grids stay far below it
// A counter holds the sum of the shares above its low kSkipBits bits and, in those, a count of
// CTAs that stored nothing: both come from the one polled value, so a wait needs no second load
// to learn that a CTA skipped. The share sum is compared modulo 2**(64 - kSkipBits) (wrap-safe:
// a call adds 2**32). A CTA skips only in a poisoned workspace, where every later call fails
// anyway; the count may then carry into the sum after 2**kSkipBits skips, which only that
// workspace's own, already failing calls read.
constexpr int kSkipBits = 12;

// Offset, in u64 words from signals[0][0], of source `src`'s share counter: right after the
// signals [2][world] and the credits [world] (dcpkit/ops/_workspace.py). The counters share
// their 128-byte lines with each other and with the signal words: one line per counter measured
// the same or slower (docs/performance.md, "Share counters").
__device__ __forceinline__ u64 share_counter_off(const Proto& p, int src) {
  return 3ull * static_cast<u64>(p.world) + static_cast<u64>(src);
}
// This CTA's share of kShareUnit.
__device__ __forceinline__ u64 cta_share() {
  const u64 g = gridDim.x;
  return kShareUnit / g + (blockIdx.x < kShareUnit % g ? 1ull : 0ull);
}
// Has the share sum of counter value v reached call e (every CTA of every call up to e added)?
__device__ __forceinline__ bool shares_reached(u64 v, u64 e) {
  return static_cast<long long>(((v >> kSkipBits) - (e << kShareShift)) << kSkipBits) >= 0;
}
// Did a CTA of this rank store nothing (its workspace poisoned)? From the own counter.
__device__ __forceinline__ bool shares_skipped(u64 v) {
  return (v & ((1ull << kSkipBits) - 1ull)) != 0ull;
}

// The publish of NOTE [dcpkit share counters]; every thread of every CTA calls it after its
// payload stores. `skipped`: this CTA stored nothing: it adds its share and one skip to its own
// rank's counter only (the peers' counters never reach the call: they time out, or see the
// poisoned workspace's mismatch, as with a missing signal).
template <Transport TR>
__device__ __forceinline__ void publish_shares(const Proto& p, u64 e, int slot, u32 fp,
                                               bool skipped) {
  __syncthreads();  // every thread's payload stores are ordered before thread 0's fence
  if (threadIdx.x != 0) return;
  if (blockIdx.x == 0) {
    // The next call's work counter (parity e + 1): its last user, the call before this one,
    // retired before this kernel started.
    reinterpret_cast<volatile u32*>(p.work)[(e + 1ull) & 1ull] = 0u;
  }
  const u64 share = cta_share() << kSkipBits;
  const u64 cnt = share_counter_off(p, p.rank);
  if (skipped) {
    fence_acq_rel_sys();
    red_relaxed_sys_add_u64(p.signals + cnt, share + 1ull);
    return;
  }
  const u64 word = signal_word(e, fp);
  if (TR == Transport::Multicast) {
    if (blockIdx.x == 0) multimem_st_relaxed_sys_u64(p.mc_sig + slot * p.world + p.rank, word);
    fence_acq_rel_sys();
    multimem_red_relaxed_sys_add_u64(p.mc_sig + cnt, share);
    return;
  }
  // Peers first (rank + 1, rank + 2, ... wrapping), this rank last. The first kSigPrefetch
  // destinations' addresses are read before the fence (a table no one writes during the call).
  u64 pre[kSigPrefetch];
  int d = p.rank;
#pragma unroll
  for (int j = 0; j < kSigPrefetch; ++j) {
    pre[j] = 0ull;
    if (j < p.world) {
      d = (d + 1 == p.world) ? 0 : d + 1;
      pre[j] = __ldg(p.peer_sig + d);
    }
  }
  if (blockIdx.x == 0) {
#pragma unroll
    for (int j = 0; j < kSigPrefetch; ++j) {
      if (j < p.world) {
        st_relaxed_sys_u64(reinterpret_cast<u64*>(pre[j]) + slot * p.world + p.rank, word);
      }
    }
    int d2 = d;
    for (int j = kSigPrefetch; j < p.world; ++j) {
      d2 = (d2 + 1 == p.world) ? 0 : d2 + 1;
      st_relaxed_sys_u64(reinterpret_cast<u64*>(__ldg(p.peer_sig + d2)) + slot * p.world + p.rank,
                         word);
    }
  }
  fence_acq_rel_sys();  // this CTA's one release
#pragma unroll
  for (int j = 0; j < kSigPrefetch; ++j) {
    if (j < p.world) red_relaxed_sys_add_u64(reinterpret_cast<u64*>(pre[j]) + cnt, share);
  }
  for (int j = kSigPrefetch; j < p.world; ++j) {
    d = (d + 1 == p.world) ? 0 : d + 1;
    red_relaxed_sys_add_u64(reinterpret_cast<u64*>(__ldg(p.peer_sig + d)) + cnt, share);
  }
}

// The waiter index of this CTA under share counters: the last min(k_waiters, grid) CTAs by
// index are waiters 0 .. K - 1 (the last CTA is the elected one, K - 1); -1 for the others.
__device__ __forceinline__ int share_waiter(u32 k_waiters) {
  const u32 n = gridDim.x;
  const u32 k = k_waiters < n ? k_waiters : n;
  return blockIdx.x + k >= n ? static_cast<int>(blockIdx.x - (n - k)) : -1;
}

// The fingerprint check of a source whose counter has reached the call: `w` is its signal word
// as loaded beside the counter's poll. Equal to this call's word: proof enough (no other call
// writes that value). Otherwise it may have been loaded before it became visible: read again,
// after the acquire (the slow path; a mismatch is recorded).
__device__ __forceinline__ bool shares_fp_ok(const Proto& p, int slot, int src, u64 e, u32 fp,
                                             u64 w, bool record) {
#if DCPKIT_SELF_CHECK
  const u64 want = signal_word(e, fp);
  if (w == want) return true;
  w = ld_relaxed_sys_u64(p.signals + slot * p.world + src);
  if (w == want) return true;
  if (record) record_failure(p, DCPKIT_REC_MISMATCH, slot, src, static_cast<u32>(e), w, fp);
  return false;
#else
  (void)p, (void)slot, (void)src, (void)e, (void)fp, (void)w, (void)record;
  return true;
#endif
}

// Poll counters[src] until its shares have reached call e (the signal word loaded beside it),
// one acquire, then the fingerprint check. Returns false on timeout or mismatch (after recording
// it), when the workspace was poisoned by another thread, or (src == rank) when a CTA of this
// rank stored nothing. A timeout records as the observed epoch the number of src's calls whose
// every CTA has published.
__device__ __forceinline__ bool wait_shares(const Proto& p, int slot, int src, u64 e, u32 fp) {
  const u64* cnt = p.signals + share_counter_off(p, src);
  const u64* sig = p.signals + slot * p.world + src;
  const u32 e32 = static_cast<u32>(e);
  u64 v = ld_relaxed_sys_u64(cnt);
  u64 w = ld_relaxed_sys_u64(sig);
  if (!shares_reached(v, e)) {
    const u64 start = globaltimer_ns();
    u32 spins = 0;
    while (true) {
      v = ld_relaxed_sys_u64(cnt);
      w = ld_relaxed_sys_u64(sig);
      if (shares_reached(v, e)) break;
      if ((++spins & 255u) == 0u) {
        if (aborted(p)) return false;
        if (globaltimer_ns() - start > p.timeout_ns) {
          const u64 other = other_ubatch_signal(p, src, true);
          if (other != 0ull) {
            record_failure(p, DCPKIT_REC_MISMATCH, slot, src, e32, other, fp);
          } else {
            const u32 seen = static_cast<u32>(v >> (kSkipBits + kShareShift));
            record_failure(p, DCPKIT_REC_TIMEOUT, slot, src, e32,
                           (w & 0xFFFFFFFF00000000ull) | seen, fp);
          }
          return false;
        }
      }
    }
  }
  acquire_polled(cnt);  // the one acquire of this source
  if (shares_skipped(v)) return false;  // this rank's own counter: a CTA stored nothing
  return shares_fp_ok(p, slot, src, e, fp, w, true);
}

// Threads [0, world) of the calling CTA wait for one source each (this rank included); then the
// CTA synchronises. Returns false (uniformly across the CTA) when any wait failed. Must be called
// by every thread of the CTA (blockDim.x >= world).
__device__ __forceinline__ bool wait_all_shares(const Proto& p, int slot, u64 e, u32 fp) {
  const int src = static_cast<int>(threadIdx.x);
  int ok = 1;
  if (src < p.world) ok = wait_shares(p, slot, src, e, fp) ? 1 : 0;
  return __syncthreads_and(ok) != 0;
}

// After a failed wait under share counters, before the epoch store and any poison: wait until
// this rank's own counter has reached the call, i.e. every CTA of this kernel has published. A
// wait fails early (the deadline of another source, or the workspace poisoned by another thread
// meanwhile) while CTAs of this kernel may still be sending: lse_reduce called in place reads
// its input, which the poison overwrites (the late CTA would send 0xFF rows, or a NaN lse read
// as an empty source, to peers that count its share as valid), and a CTA that has not started
// would read the new epoch. Every CTA publishes before it waits for anything, so this ends once
// they have run (the co-residency rule); its own deadline, timeout_ns more, only bounds a GPU
// that never runs them. The acquire orders the late CTAs' loads before this CTA's stores.
// CTA-uniform; every thread of the CTA calls it.
__device__ __forceinline__ void settle_own_shares(const Proto& p, u64 e) {
  if (threadIdx.x == 0) {
    const u64* cnt = p.signals + share_counter_off(p, p.rank);
    if (!shares_reached(ld_relaxed_sys_u64(cnt), e)) {
      const u64 start = globaltimer_ns();
      u32 spins = 0;
      while (!shares_reached(ld_relaxed_sys_u64(cnt), e)) {
        if ((++spins & 255u) == 0u && globaltimer_ns() - start > p.timeout_ns) break;
      }
    }
    acquire_polled(cnt);
  }
  __syncthreads();
}

// The waiters' step under share counters (the push gathers and lse_reduce): every source's
// counter (wait_all_shares); after a failed wait, or in a workspace poisoned when the kernel
// started (`dead`), this rank's own counter all the same (settle_own_shares); then the elected
// waiter stores the new epoch. True: every wait passed and the call may use the data; false:
// the caller poisons (what it owns). CTA-uniform; every thread of the CTA calls it.
__device__ __forceinline__ bool waiter_shares(const Proto& p, int slot, u64 e, u32 fp, bool dead,
                                              bool elected) {
  const bool ok = wait_all_shares(p, slot, e, fp) && !dead;  // the wait always runs
  if (!ok) settle_own_shares(p, e);
  if (elected && threadIdx.x == 0) *reinterpret_cast<volatile u64*>(p.epoch) = e;
  return ok;
}

// Helping under share counters (try_all_sources' counterpart): a bounded spin for every
// source's counter; with all there (fingerprints checked, no CTA of this rank skipped, the
// workspace not poisoned) the CTA helps. CTA-uniform; records nothing.
__device__ __forceinline__ bool try_all_shares(const Proto& p, int slot, u64 e, u32 fp,
                                               u32 units) {
  int ok = 1;
  const int src = static_cast<int>(threadIdx.x);
  if (src < p.world) {
    const u64* cnt = p.signals + share_counter_off(p, src);
    const u64* sig = p.signals + slot * p.world + src;
    u64 v = ld_relaxed_sys_u64(cnt);
    u64 w = ld_relaxed_sys_u64(sig);
    if (!shares_reached(v, e)) {
      const u64 budget = help_budget_ns(units, p.waiters);
      const volatile u32* work = p.work + slot;
      const u64 start = globaltimer_ns();
      u32 spins = 0;
      do {
        v = ld_relaxed_sys_u64(cnt);
        w = ld_relaxed_sys_u64(sig);
        if ((++spins & 63u) == 0u && *work >= units) break;  // every unit already claimed
      } while (!shares_reached(v, e) && globaltimer_ns() - start < budget);
    }
    ok = shares_reached(v, e) ? 1 : 0;
    if (ok) {
      acquire_polled(cnt);
      ok = !shares_skipped(v) && shares_fp_ok(p, slot, src, e, fp, w, false) && !aborted(p) ? 1
                                                                                               : 0;
    }
  }
  return __syncthreads_and(ok) != 0;
}

// 0xFF bytes over `rows` rows of `row_vecs` 16-byte vectors (row stride `stride` bytes), shared
// by CTAs [0, ncta) of which this is `cta`: the poison pattern (NaN in every float dtype).
__device__ __forceinline__ void poison_fill16(char* dst, long long stride, u32 rows, u32 row_vecs,
                                              u32 cta, u32 ncta) {
  const uint4 ff = make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  const unsigned long long n = static_cast<unsigned long long>(rows) * row_vecs;
  for (unsigned long long i = static_cast<unsigned long long>(cta) * blockDim.x + threadIdx.x;
       i < n; i += static_cast<unsigned long long>(ncta) * blockDim.x) {
    const unsigned long long r = i / row_vecs;
    st16(dst + r * stride + (i - r * row_vecs) * 16ull, ff);
  }
}

}  // namespace dcpkit
