"""The collective paths of :class:`~dcpkit.vllm.MLADCPManager` (a mixin of it): the
all-to-all, all-gather + reduce-scatter and all-gather + all-reduce combines and the query
all-gather, on :class:`~dcpkit.vllm._collectives.GroupCollectives` plus dcpkit's merge.

They read the manager's geometry (``world_size``, ``rank``, ``num_heads``, ``output_head_dim``,
``output_dtype``, ``query_head_dim``, ``query_dtype``, ``padded_num_heads``,
``is_lse_base_on_e``, ``device``) and its ``_coll``; see :mod:`dcpkit.vllm._collectives` for how
the data travels and the merge.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ..errors import InvalidArgument
from ._collectives import merge_weights, natural_lse, to_base, weighted
from ._common import check_bool, check_combine_inputs, check_tensor
from ._workspaces import on_device

__all__ = ["CollectivePaths", "CombineCall"]


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


class CombineCall(NamedTuple):
    """One combine's arguments, as ``MLADCPManager.combine`` takes them."""

    partial_output: object
    partial_lse: object
    seq_lens: object
    query_start_loc: object
    return_lse: object
    out: object
    out_lse: object


class CollectivePaths:
    """The combine and query-gather paths that run on the group's collectives."""

    def _combine_on(
        self,
        path: str,
        partial_output,
        partial_lse,
        *,
        seq_lens=None,
        query_start_loc=None,
        return_lse=False,
        out=None,
        out_lse=None,
    ):
        """``combine`` on ``path`` (``"a2a"``, ``"ag-rs"``, ``"ag-ar"`` or ``"direct"``), with
        vLLM's signature; every path below takes the arguments as one :class:`CombineCall`."""
        call = CombineCall(
            partial_output, partial_lse, seq_lens, query_start_loc, return_lse, out, out_lse
        )
        if path == "a2a":
            return self._a2a_combine(call)
        if path == "direct":
            return self._direct_combine(call)
        return self._ag_combine(call, scatter=path == "ag-rs")

    #: All-to-all of the owned head slices and lses on the group, then dcpkit's merge.
    _combine_a2a = functools.partialmethod(_combine_on, "a2a")
    #: All-gather of the lse, reduce-scatter of the weighted partials: ``[T, H, D]`` ->
    #: ``[T, H / world_size, D]``.
    _combine_ag_rs = functools.partialmethod(_combine_on, "ag-rs")
    #: All-gather of the lse, all-reduce of the weighted partials: ``[T, H, D]`` -> ``[T, H, D]``.
    _combine_ag_ar = functools.partialmethod(_combine_on, "ag-ar")

    def _direct_combine(self, call: CombineCall):  # the manager's
        raise NotImplementedError

    def _check_combine(self, what, call: CombineCall, heads_out):
        """The call checks every combine path shares; returns ``(T, H)``."""
        partial_output, partial_lse, seq_lens, query_start_loc, return_lse, out, out_lse = call
        self._check_open(what)
        check_bool(return_lse, what, "return_lse")
        check_tensor(
            partial_output,
            what,
            "partial_output",
            device=self.device,
            dtypes=(self.output_dtype,),
            ndim=3,
        )
        T, H, D = partial_output.shape
        if D != self.output_head_dim:
            raise InvalidArgument(
                f"{what}: partial_output head_dim must be output_head_dim "
                f"{self.output_head_dim} (got {D})"
            )
        masks, outs, out_shape = (seq_lens, query_start_loc), (out, out_lse), (T, heads_out(H), D)
        check_combine_inputs(
            what, self.device, partial_lse, (T, H), masks, outs, out_shape, self.output_dtype
        )
        return T, H

    def _a2a_heads(self, what):
        want = self.world_size * self.num_heads

        def heads(H):
            if H != want:
                raise InvalidArgument(
                    f"{what}: partial_output heads must be world_size * "
                    f"num_heads = {want} (got {H})"
                )
            return self.num_heads

        return heads

    def _a2a_combine(self, call: CombineCall):
        what = "MLADCPManager.combine"
        T, _ = self._check_combine(what, call, self._a2a_heads(what))
        partial_output, partial_lse, seq_lens, query_start_loc, return_lse, out, out_lse = call
        self._coll.check_not_capturing(what)
        torch, W, H_r, D = self._torch, self.world_size, self.num_heads, self.output_head_dim
        lse = natural_lse(partial_lse, self.is_lse_base_on_e, seq_lens, query_start_loc)
        send_out = partial_output.reshape(T, W, H_r, D).transpose(0, 1).contiguous()
        send_lse = lse.view(T, W, H_r).transpose(0, 1).contiguous()
        recv_out = self._coll.all_to_all(send_out)
        recv_lse = self._coll.all_to_all(send_lse)
        if out is None:
            out = torch.empty((T, H_r, D), dtype=self.output_dtype, device=self.device)
        if return_lse and out_lse is None:
            out_lse = torch.empty((T, H_r), dtype=torch.float32, device=self.device)
        if T:
            self._merge(recv_out, recv_lse, out, out_lse)
            if out_lse is not None and not self.is_lse_base_on_e:
                out_lse.copy_(to_base(out_lse, False))
        self._count("combine:a2a")
        return (out, out_lse) if return_lse else out

    def _merge(self, src_out, src_lse, out, out_lse) -> None:
        """dcpkit's merge of ``src_out [W, T, h, D]`` with ``src_lse [W, T, h]`` (natural log)
        into ``out`` (and ``out_lse``): the merge kernel where it serves, else the same merge
        in torch."""
        odt = self.output_dtype
        if (
            self.device.type == "cuda"
            and _name(odt) in ("float16", "bfloat16", "float32")
            and (src_out.shape[-1] * odt.itemsize) % 16 == 0
            and src_out.shape[0] <= 64
        ):
            self._lse_combine(src_out, src_lse, out, out_lse)
            return
        w, merged = merge_weights(src_lse)
        out.copy_(weighted(w[..., None], src_out).sum(0))
        if out_lse is not None:
            out_lse.copy_(merged)

    def _lse_combine(self, src_out, src_lse, out, out_lse) -> None:
        from .._torch_registry import torch_module
        from .._torch_streams import current_stream
        from ..ops import lse_combine
        from ..torch import to_cupy

        idx = self.device.index
        with on_device(idx):
            lse_combine(
                to_cupy(src_out.contiguous(), name="src_out"),
                to_cupy(src_lse.contiguous(), name="src_lse"),
                to_cupy(out, name="out"),
                None if out_lse is None else to_cupy(out_lse, name="out_lse"),
                stream=current_stream(torch_module(), idx),
            )

    def _ag_combine(self, call: CombineCall, scatter: bool):
        what = "MLADCPManager.combine"
        W, r = self.world_size, self.rank

        def heads(H):
            if scatter and H % W:
                raise InvalidArgument(
                    f"{what}: partial_output heads must be a multiple of world_size {W} (got {H})"
                )
            return H // W if scatter else H

        T, H = self._check_combine(what, call, heads)
        partial_output, partial_lse, seq_lens, query_start_loc, return_lse, out, out_lse = call
        self._coll.check_not_capturing(what)
        torch, D = self._torch, self.output_head_dim
        lse = natural_lse(partial_lse, self.is_lse_base_on_e, seq_lens, query_start_loc)
        lses = self._coll.all_gather(lse)  # [W, T, H]
        w, merged = merge_weights(lses)
        mine = weighted(w[r][..., None], partial_output)  # [T, H, D] fp32
        if scatter:
            h = H // W
            res = self._coll.reduce_scatter(mine.view(T, W, h, D).transpose(0, 1))
            merged = merged[:, r * h : (r + 1) * h]
        else:
            h = H
            res = self._coll.all_reduce(mine)
        if out is None:
            out = torch.empty((T, h, D), dtype=self.output_dtype, device=self.device)
        out.copy_(res)
        if out_lse is not None:
            out_lse.copy_(to_base(merged, self.is_lse_base_on_e))
        elif return_lse:
            out_lse = to_base(merged, self.is_lse_base_on_e).contiguous()
        self._count(f"combine:{'ag-rs' if scatter else 'ag-ar'}")
        return (out, out_lse) if return_lse else out

    def _gather_query(self, local_query):
        """All-gather of the query heads on the group into new storage of ``padded_num_heads``
        heads per token (vLLM's ``reserve_query_head_storage``): ``[T, H_r, D_q]`` ->
        ``[T, world_size * H_r, D_q]`` with strides ``(W*H_r*D_q, D_q, 1)``."""
        what = "MLADCPManager.query_gather"
        self._check_open(what)
        torch, W, H_r, D = self._torch, self.world_size, self.num_heads, self.query_head_dim
        check_tensor(
            local_query, what, "local_query", device=self.device, dtypes=(self.query_dtype,), ndim=3
        )
        if tuple(local_query.shape[1:]) != (H_r, D):
            raise InvalidArgument(
                f"{what}: local_query shape must be [T, {H_r}, {D}] (got {list(local_query.shape)})"
            )
        self._coll.check_not_capturing(what)
        T, H = local_query.shape[0], W * H_r
        storage = H if self.padded_num_heads is None else self.padded_num_heads
        flat = torch.empty(max(T * storage * D, 1), dtype=self.query_dtype, device=self.device)
        out = torch.as_strided(flat, (T, H, D), (H * D, D, 1))
        if T:
            every = self._coll.all_gather(local_query)  # [W, T, H_r, D]
            out.view(T, W, H_r, D).copy_(every.transpose(0, 1))
        self._count("query_gather:all-gather")
        return out
