// kv_gather.cu: every rank gets every rank's [T, D_kv] block, rank-major, bit for bit
// all_gather_into_tensor(kv). One launch per call. The slot holds the contiguous [W*T, D_kv]
// result, so a rank's block is one flat run of 16-byte vectors: the gather geometry of one row
// (gather.cuh).
#include "gather.cuh"

namespace dcpkit {

// kv_gather_push_kernel<TR>: every rank stores its block into every rank's slot (gather.cuh
// gather_push_call).
//   peer_data : u64 [world], address of data slot 0 of this ubatch on every rank
//   slot_bytes: bytes of one data slot (NOTE [dcpkit gather slots])
//   mc_data   : multicast address of data slot 0 (0 for Unicast)
//   kv        : [T, D_kv] of this rank, C-contiguous, 16-byte aligned
//   block_vecs: T * D_kv * itemsize / 16 (rank s's block sits at byte s * block_vecs * 16)
//   tokens    : T (for the fingerprint of the signals)
//   out       : nullptr (zero copy: the result is read from the own data slot), or the
//               C-contiguous copy-out destination [W*T, D_kv]
// Grid: any number of CTAs of kGatherThreads threads; at most P.waiters of them wait
// (NOTE [dcpkit epoch signalling], co-residency rule).
template <Transport TR>
__global__ void __launch_bounds__(kGatherThreads, kGatherMinBlocks)
kv_gather_push_kernel(DCPKIT_PROTO_PARAMS, const u64* peer_data, u64 slot_bytes, u64 mc_data,
                      const char* kv, u32 block_vecs, u32 tokens, char* out) {
  const Proto P = DCPKIT_PROTO_MAKE();
  const GatherGeom g{1u, block_vecs, 0ll, 0ll, 0ll, tokens};
  gather_push_call<TR>(P, peer_data, slot_bytes, mc_data, kv, g, out);
}

template __global__ void kv_gather_push_kernel<Transport::Unicast>(
    DCPKIT_PROTO_PARAMS, const u64*, u64, u64, const char*, u32, u32, char*);
template __global__ void kv_gather_push_kernel<Transport::Multicast>(
    DCPKIT_PROTO_PARAMS, const u64*, u64, u64, const char*, u32, u32, char*);

// kv_gather_pull_kernel: every rank stages its block in its own slot, then loads every peer's
// block from that peer's slot (gather.cuh gather_pull_call; unicast only). Parameters as above,
// without mc_data.
__global__ void __launch_bounds__(kGatherThreads, kGatherMinBlocks)
kv_gather_pull_kernel(DCPKIT_PROTO_PARAMS, const u64* peer_data, u64 slot_bytes,
                      const char* kv, u32 block_vecs, u32 tokens, char* out) {
  const Proto P = DCPKIT_PROTO_MAKE();
  const GatherGeom g{1u, block_vecs, 0ll, 0ll, 0ll, tokens};
  gather_pull_call(P, peer_data, slot_bytes, kv, g, out);
}

}  // namespace dcpkit
