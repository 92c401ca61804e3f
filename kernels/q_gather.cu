// q_gather.cu: every rank gets the queries of all heads, bit for bit all_gather(q, dim=1).
// One launch per call; the device code is gather_push_call in gather.cuh.
#include "gather.cuh"

namespace dcpkit {

// q_gather_kernel<TR>: one q_gather call (dcpkit/ops/q_gather.py).
//   peer_data        : u64 [world], address of data slot 0 of this ubatch on every rank
//   slot_bytes       : bytes of one data slot (NOTE [dcpkit gather slots])
//   mc_data          : multicast address of data slot 0 (0 for Unicast)
//   q                : [T, H_r, D] of this rank, heads contiguous, 16-byte aligned
//   q_token_stride   : bytes between tokens of q (>= H_r * D * itemsize, multiple of 16)
//   row_vecs         : H_r * D * itemsize / 16
//   slot_token_stride: H_pad * D * itemsize (slot layout [T_max][H_pad][D])
//   tokens           : T
//   out              : nullptr (zero copy: the result is read from the own data slot), or the
//                      copy-out destination [T, H, D] with heads contiguous
//   out_token_stride : bytes between tokens of out
// Grid: any number of CTAs of kGatherThreads threads; at most P.waiters of them wait
// (NOTE [dcpkit epoch signalling], co-residency rule).
template <Transport TR>
__global__ void __launch_bounds__(kGatherThreads, kGatherMinBlocks)
q_gather_kernel(DCPKIT_PROTO_PARAMS, const u64* peer_data, u64 slot_bytes, u64 mc_data,
                const char* q, long long q_token_stride, u32 row_vecs,
                long long slot_token_stride, u32 tokens, char* out,
                long long out_token_stride) {
  const Proto P = DCPKIT_PROTO_MAKE();
  const GatherGeom g{tokens, row_vecs, q_token_stride, slot_token_stride, out_token_stride,
                    tokens};
  gather_push_call<TR>(P, peer_data, slot_bytes, mc_data, q, g, out);
}

template __global__ void q_gather_kernel<Transport::Unicast>(
    DCPKIT_PROTO_PARAMS, const u64*, u64, u64, const char*, long long, u32, long long, u32,
    char*, long long);
template __global__ void q_gather_kernel<Transport::Multicast>(
    DCPKIT_PROTO_PARAMS, const u64*, u64, u64, const char*, long long, u32, long long, u32,
    char*, long long);

}  // namespace dcpkit
