"""The workspace output buffers of the ops (a part of :class:`~dcpkit.ops._workspace.OpWorkspace`):
the pool of graph output buffers, which the push gathers keep in the symmetric region (NOTE
[dcpkit zero-copy graph outputs] in ``kernels/gather.cuh``), and the two eager buffers of each
ubatch. See "Outputs" in :mod:`dcpkit.ops._workspace`."""

from __future__ import annotations

from ..errors import DcpkitError

__all__ = ["OutputBuffers", "DEFAULT_GRAPH_OUTPUTS"]

#: Graph output buffers of a workspace unless its constructor says otherwise.
DEFAULT_GRAPH_OUTPUTS = 4


class OutputBuffers:
    """Mixin of :class:`~dcpkit.ops._workspace.OpWorkspace`. Reads ``graph_outputs``,
    ``_pool_stride``, ``_pool_in_region``, ``_out_bytes``, ``_calls``, ``device`` and
    ``op_name`` of the workspace."""

    def _init_outputs(self, cupy, region_pool: int) -> None:
        """The graph output pool (at ``region_pool`` in the symmetric region when
        ``_pool_in_region``, else ordinary device memory) and the lazily allocated eager
        buffers. Runs on the workspace's device."""
        n_graph = getattr(self, "graph_outputs", DEFAULT_GRAPH_OUTPUTS)
        if getattr(self, "_pool_in_region", False):
            self._graph_out = None
            self._graph_base = region_pool
        else:
            self._graph_out = cupy.empty(max(self._pool_stride * n_graph, 1), dtype=cupy.uint8)
            self._graph_base = self._graph_out.data.ptr
        self._graph_next = 0
        self._eager_out: list[object | None] = [None] * self.num_ubatches

    def _symmetric_graph_outputs(self) -> bool:
        """Whether the graph output buffers lie in the symmetric region (the push gathers, whose
        peers store into them); False: ordinary device memory."""
        return False

    def output_ptr(self, ubatch: int, capturing: bool) -> int:
        """Device address of the workspace output buffer for this call (``out=None``): a graph
        output buffer of its own while capturing (taken for good), else one of the two eager
        buffers of the ubatch."""
        if capturing:
            k = self._graph_next
            if k >= self.graph_outputs:  # begin_call checked; an internal invariant
                raise DcpkitError(f"{self.op_name}: graph output buffers exhausted")
            self._graph_next = k + 1
            return self._graph_base + k * self._pool_stride
        buf = self._eager_out[ubatch]
        if buf is None:
            import cupy

            with cupy.cuda.Device(self.device):
                buf = cupy.empty(2 * max(self._out_bytes, 1), dtype=cupy.uint8)
            self._eager_out[ubatch] = buf
        return buf.data.ptr + (self._calls[ubatch] & 1) * self._out_bytes

    def release_graph_outputs(self) -> None:
        """Give every graph output buffer back to the pool, for the captures that follow.

        Call it only once no graph that captured a call of this workspace without ``out=`` will
        be replayed again (destroyed, or never launched again), and never while such a capture
        is in progress (its later calls would reuse the buffers of its earlier ones): the
        results of those calls become invalid, and later captures reuse their buffers.
        Local to this rank, no GPU work; ranks may call it at different times (a peer stores
        into the buffer the receiving rank names)."""
        self.check_open()
        self._graph_next = 0
