"""The collective paths of :class:`~dcpkit.vllm.MLADCPManager`: the all-to-all, all-gather +
reduce-scatter and all-gather + all-reduce combines, the all-gather query gather and the
``all_gather_into_tensor`` KV gather, on ``torch.distributed`` collectives of the group (or the
host exchange of a dcpkit Communicator) plus dcpkit's LSE merge.

How the data travels (:class:`GroupCollectives`, decided once from the group's backend):

* ``"device"``: a torch group whose backend includes NCCL: the collectives run on the GPU
  tensors (capturable in a CUDA graph, as NCCL is).
* ``"host"``: any other torch backend (gloo, ...): the tensors are copied to the host, the
  collective runs on CPU tensors (gloo's CPU collectives cover all four used here), the result
  is copied back. The copies synchronise: not capturable (refused with a clear error).
* ``"comm"``: a dcpkit Communicator without a torch group (``Communicator.from_mpi()``): the
  bytes travel through its host ``allgather``; reductions sum in rank order. Not capturable.

Merge (dcpkit's, DESIGN.md "The three ops: contracts"): every lse is taken to natural log and
fp32; NaN and +inf count as -inf; rows of a request with ``seq_lens == 0`` and padding rows at
or past ``query_start_loc[-1]`` are set to -inf at the sender; weights ``exp(l - m) / sum``; a
source of weight 0 is never read (it may hold NaN); partial outputs are accumulated in fp32 and
rounded once. The all-to-all path merges with :func:`dcpkit.ops.lse_combine` (the merge kernel
of the direct op); the all-gather paths scale their own partial by its weight in fp32 and let
the reduce-scatter / all-reduce (in fp32) do the sum.
"""

from __future__ import annotations

from ..errors import InvalidArgument
from ._common import LN2, LOG2E, NO_TORCH_GROUP, require_torch

__all__ = ["GroupCollectives", "natural_lse", "merge_weights"]


class GroupCollectives:
    """All-gather, all-to-all, reduce-scatter and all-reduce over the group, any backend.

    Parameters
    ----------
    comm : Communicator
        The group's dcpkit Communicator (for ``"comm"`` mode).
    torch_group : ProcessGroup, None or NO_TORCH_GROUP
        The torch group (None = the default group).
    device : torch.device
        Where inputs and results live.

    Attributes
    ----------
    mode : str
        ``"device"``, ``"host"`` or ``"comm"`` (module docstring).
    backend : str
        The torch backend name, or ``"dcpkit <backend>"``.
    """

    def __init__(self, comm, torch_group, device):
        self.comm = comm
        self.world_size = comm.world_size
        self.rank = comm.rank
        self.device = device
        self._torch = require_torch("dcpkit.vllm")
        if torch_group is NO_TORCH_GROUP:
            self.group = None
            self.mode = "comm"
            self.backend = f"dcpkit {comm.backend}"
        else:
            import torch.distributed as dist

            self._dist = dist
            self.group = torch_group
            self.backend = str(dist.get_backend(torch_group))
            self.mode = "device" if "nccl" in self.backend.lower() else "host"

    @property
    def capturable(self) -> bool:
        return self.mode == "device"

    def check_not_capturing(self, what: str) -> None:
        """Refuse a host-staged collective inside a CUDA-graph capture."""
        if (
            self.mode != "device"
            and self.device.type == "cuda"
            and self._torch.cuda.is_current_stream_capturing()
        ):
            raise InvalidArgument(
                f"{what}: the collective path on a {self.backend} group copies through the host "
                f"and must not run while a CUDA graph captures (got a capturing stream): use a "
                f"group with NCCL, or the direct path (T <= max_num_tokens)"
            )

    # ------------------------------------------------------------------ helpers
    def _bytes(self, x):
        return x.contiguous().view(-1).view(self._torch.uint8)

    def _host_allgather(self, xb):
        """Every rank's bytes through the Communicator, as one uint8 tensor on the device."""
        torch = self._torch
        parts = self.comm.allgather(xb.cpu().numpy().tobytes())
        flat = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
        return flat.to(self.device)

    # ------------------------------------------------------------------ collectives
    def all_gather(self, x):
        """``[W, *x.shape]``: slot ``s`` is rank ``s``'s ``x``, bit for bit (any dtype)."""
        torch = self._torch
        W = self.world_size
        xb = self._bytes(x)
        if self.mode == "comm":
            out = self._host_allgather(xb)
        elif self.mode == "device":
            out = torch.empty(W * xb.numel(), dtype=torch.uint8, device=self.device)
            self._dist.all_gather_into_tensor(out, xb, group=self.group)
        else:
            host = torch.empty(W * xb.numel(), dtype=torch.uint8)
            self._dist.all_gather_into_tensor(host, xb.cpu(), group=self.group)
            out = host.to(self.device)
        return out.view(x.dtype).view((W,) + tuple(x.shape))

    def all_gather_into(self, out, x) -> None:
        """``all_gather_into_tensor(out, x)`` (``out`` contiguous ``[W*T, ...]``)."""
        if self.mode == "device":
            self._dist.all_gather_into_tensor(
                self._bytes(out) if out.is_contiguous() else out, self._bytes(x), group=self.group
            )
            return
        out.copy_(self.all_gather(x).view(out.shape))

    def all_to_all(self, x):
        """``x [W, ...]`` -> ``[W, ...]`` whose slot ``s`` is rank ``s``'s ``x[rank]``."""
        torch = self._torch
        W, r = self.world_size, self.rank
        xb = self._bytes(x)
        if self.mode == "comm":
            n = xb.numel() // W
            every = self._host_allgather(xb).view(W, W, n)
            out = every[:, r].contiguous()
        elif self.mode == "device":
            out = torch.empty_like(xb)
            self._dist.all_to_all_single(out, xb, group=self.group)
        else:
            host = torch.empty(xb.numel(), dtype=torch.uint8)
            self._dist.all_to_all_single(host, xb.cpu(), group=self.group)
            out = host.to(self.device)
        return out.view(x.dtype).view(tuple(x.shape))

    def reduce_scatter(self, x):
        """``x [W, ...]`` float32 -> ``x.shape[1:]``: the sum over ranks of slot ``rank``."""
        torch = self._torch
        x = x.contiguous()
        if self.mode == "comm":
            return self.all_gather(x)[:, self.rank].sum(0)  # [W(src), W, ...]
        # flat tensors: gloo checks output.shape[0] * world_size == input.shape[0]
        shape, n = x.shape[1:], x[0].numel()
        if self.mode == "device":
            out = torch.empty(n, dtype=x.dtype, device=self.device)
            self._dist.reduce_scatter_tensor(out, x.view(-1), group=self.group)
            return out.view(shape)
        host = torch.empty(n, dtype=x.dtype)
        self._dist.reduce_scatter_tensor(host, x.view(-1).cpu(), group=self.group)
        return host.to(self.device).view(shape)

    def all_reduce(self, x):
        """The sum over ranks of ``x`` (float32)."""
        x = x.contiguous()
        if self.mode == "comm":
            return self.all_gather(x).sum(0)
        if self.mode == "device":
            self._dist.all_reduce(x, group=self.group)
            return x
        host = x.cpu()
        self._dist.all_reduce(host, group=self.group)
        return host.to(self.device)


# ----------------------------------------------------------------------------- merge
def natural_lse(partial_lse, is_lse_base_on_e: bool, seq_lens, query_start_loc):
    """A new float32 natural-log copy of ``partial_lse [T, H]`` with the empty rows (requests
    with ``seq_lens == 0``, padding rows at or past ``query_start_loc[-1]``) set to -inf."""
    torch = require_torch("dcpkit.vllm")
    lse = partial_lse.to(torch.float32, copy=True).contiguous()
    if not is_lse_base_on_e:
        lse.mul_(LN2)
    if query_start_loc is None:
        return lse
    T, S = lse.shape[0], seq_lens.shape[0]
    rows = torch.arange(T, device=lse.device, dtype=query_start_loc.dtype)
    empty = rows >= query_start_loc[-1]
    if S > 0:
        seq = torch.searchsorted(query_start_loc[1:].contiguous(), rows, right=True).clamp_max(
            S - 1
        )
        empty = empty | (seq_lens[seq] == 0)
    lse.masked_fill_(empty[:, None], float("-inf"))
    return lse


def merge_weights(lses):
    """``lses [W, T, h]`` natural-log fp32 -> ``(w [W, T, h], merged [T, h])``: dcpkit's weights
    (NaN and +inf as -inf; 0 for an empty source) and the merged lse (-inf where every source is
    empty)."""
    torch = require_torch("dcpkit.vllm")
    ninf = float("-inf")
    l = torch.where(torch.isnan(lses) | (lses == float("inf")), ninf, lses)
    m = l.amax(0)
    m0 = torch.where(m == ninf, 0.0, m)
    e = torch.exp(l - m0)
    s = e.sum(0)
    has = s > 0
    w = e / torch.where(has, s, 1.0)
    merged = torch.where(has, m0 + torch.log(torch.where(has, s, 1.0)), ninf)
    return w, merged


def weighted(w, x):
    """``w [..., 1] * x`` in fp32, exactly 0 where ``w == 0`` (``x`` may hold NaN there)."""
    torch = require_torch("dcpkit.vllm")
    return torch.where(w > 0, w * x.float(), 0.0)


def to_base(lse, is_lse_base_on_e: bool):
    """A natural-log lse in the caller's base (base 2 when ``is_lse_base_on_e`` is False)."""
    return lse if is_lse_base_on_e else lse * LOG2E
