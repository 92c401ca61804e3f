"""The call signature of ``lse_reduce``, written once for the direct op, the NCCL op
(:class:`LseReduceCall`) and :meth:`DCPComm.lse_reduce <dcpkit.manager.DCPComm.lse_reduce>`
(:func:`lse_reduce_method`)."""

from __future__ import annotations

from ._plan import arrays_key

__all__ = ["LseReduceCall", "lse_reduce_method"]


def lse_reduce_method(qualname: str, doc: str):
    """The ``lse_reduce`` call as a method named ``qualname`` with docstring ``doc``: the
    arguments, in the order of the signature, go as one tuple to the keyed entry
    ``self._lse_keyed(key, arrays, ubatch, stream)``, with ``key`` the flat key of
    :func:`dcpkit._plan.arrays_key` (None where the arguments have no flat key). One name for
    every class's entry, so that the call is a plain method call (a ``getattr`` by a name
    chosen per class costs about 500 instructions more per call)."""

    def lse_reduce(
        self,
        out_partial,
        lse_partial,
        *,
        seq_lens=None,
        query_start_loc=None,
        ubatch: int = 0,
        out=None,
        out_lse=None,
        stream=None,
    ):
        arrays = (out_partial, lse_partial, seq_lens, query_start_loc, out, out_lse)
        return self._lse_keyed(arrays_key(arrays, ubatch), arrays, ubatch, stream)

    lse_reduce.__name__ = qualname.rsplit(".", 1)[-1]
    lse_reduce.__qualname__ = qualname
    lse_reduce.__doc__ = doc
    return lse_reduce


class LseReduceCall:
    """``__call__`` of an ``lse_reduce`` op (:func:`lse_reduce_method`): the op's entry is
    ``_lse_keyed(key, arrays, ubatch, stream)``."""

    __slots__ = ()

    __call__ = lse_reduce_method(
        "LseReduceCall.__call__",
        """Merge every rank's partial attention into this rank's heads.

        The call of :class:`~dcpkit.ops.LseReduce` and :class:`~dcpkit.nccl.NcclLseReduce`
        (naive equivalent: the class docstring). What is said below is the direct op's
        contract; the NCCL op differs where its class docstring says so: any strides for every
        array, a float64 ``lse_partial`` too, ``out [T, H_out, D_v]`` / ``out_lse [T, H_out]``
        with ``H_out = out_heads``, and only :class:`InvalidArgument`, :class:`InvalidType` and
        :class:`ClosedError` raised by the call itself.

        Parameters
        ----------
        out_partial : array [T, H, D_v], dtype of the workspace
            This rank's partial attention output of all heads. ``1 <= T <= max_tokens`` (``T ==
            0`` returns empty arrays and launches nothing). Rows must be 16-byte aligned: data
            pointer, token stride and head stride multiples of 16 bytes (padded head or token
            storage is fine). An innermost stride other than the itemsize costs a copy to a
            contiguous array first (on ``stream``; it allocates, so avoid it under graph capture).
        lse_partial : array [T, H], float32, float16 or bfloat16
            This rank's partial log-sum-exp (base ``lse_base``), any non-negative strides. NaN
            and +inf count as -inf (an empty or invalid shard).
        seq_lens : int32 array [S], optional
            This rank's KV length of every request, contiguous; a request with 0 here counts as
            empty on this rank. Requires ``query_start_loc``.
        query_start_loc : int32 array [S+1], optional
            Row offsets of the requests (non-decreasing, equal on every rank), contiguous; rows
            at or past ``query_start_loc[S]`` are padding, empty on every rank. Rows before
            ``query_start_loc[0]`` belong to no request.
        ubatch : int
            Which ubatch's epochs, signals and slots to use, in ``[0, num_ubatches)``.
        out : array [T, H_r, D_v], dtype of the workspace, optional
            C-contiguous, 16-byte aligned destination (required for allocation-free capture
            of a result that must outlive the next replay).
        out_lse : float32 array [T, H_r], optional
            C-contiguous destination of the merged natural-log lse; passing it makes the call
            return ``(out, out_lse)``.
        stream : cupy.cuda.Stream, optional
            Stream of the launch (default: the current CuPy stream of the op's GPU; a
            stream of another GPU is refused).

        Returns
        -------
        out : array [T, H_r, D_v]
            Output of heads ``[rank*H_r, (rank+1)*H_r)``: ``out=`` or a view of a workspace
            output buffer (lifetime: see the class docstring). Rows whose sources are all empty
            are 0.
        out_lse : float32 array [T, H_r]
            Only with ``return_lse=True`` or ``out_lse=``: the merged natural-log lse, -inf for
            rows whose sources are all empty.

        Collective: every rank calls with the same ``T``, dtypes, masks present or not and
        ubatch, in the same order.

        Stream: enqueued on ``stream``; the host does not wait.

        Raises
        ------
        InvalidType
            A host array or a non-array, a wrong dtype, a non-integer ubatch, a ``stream`` that
            is not a CuPy stream.
        InvalidArgument
            A wrong shape, ``T > max_tokens``, rows not 16-byte aligned, negative strides, an
            array on another GPU, ``seq_lens`` without ``query_start_loc`` or of the wrong
            length, a non-contiguous ``seq_lens`` / ``query_start_loc`` / ``out`` / ``out_lse``,
            a ubatch out of range.
        ClosedError
            The workspace is closed.
        CollectiveTimeout
            An earlier call timed out waiting for a peer (the workspace is poisoned).
        ConfigMismatch
            An earlier call found that the ranks called with a different ``T``, lse dtype, mask
            presence or ubatch (the workspace is poisoned); names the ranks and values.
        DcpkitError
            The workspace's first call is being captured, or every graph output buffer is taken
            while capturing a call that needs one.

        Every check runs before anything is launched or counted: after a rejected call the
        workspace is unchanged and usable.
        """,
    )
