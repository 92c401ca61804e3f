"""What QGather and KVGather share: the data-slot ring, the result views and the launch.

Both gathers run one kernel per call (``kernels/gather.cuh``): every rank stores its block into
the same place of every rank's data slot and signals; the result is read from the own slot.

Data slots. A gather keeps **three** data slots per ubatch (data slot = epoch % 3), carved out of
the two slots of :class:`~dcpkit.ops._workspace.OpWorkspace` (signals keep their two slots,
epoch & 1). With two data slots a zero-copy view of call ``n`` would be overwritten by a peer's
call ``n + 2`` as soon as this rank issued call ``n + 1``; with three, the rule every docstring
states holds: a view returned by call ``n`` stays valid while it is consumed on the same stream
before call ``n + 2`` of the same ubatch is issued (call ``n + 3`` reuses its storage). See
NOTE [dcpkit gather slots] in ``kernels/gather.cuh``.

Where the result goes (decided per call, the same on every rank or not: it does not change the
protocol):

* ``out=`` given: copy-out into ``out``; ``out`` is returned.
* eager call of a ubatch never captured: a view of the own data slot (zero copy).
* eager call after a capture: copy-out into one of two workspace output buffers, alternating.
* call while the stream is capturing: the call's own graph output buffer (``out=None``), which
  the push gathers keep in the symmetric region: the peers store straight into it, after a
  credit that says the buffer's previous result has been consumed (zero copy, NOTE [dcpkit
  zero-copy graph outputs] in ``kernels/gather.cuh``); the pull gathers copy into it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _cuda
from ._workspace import OpWorkspace, _round_up, launch_config

__all__ = ["GatherWorkspace", "GatherPlan", "DATA_SLOTS", "THREADS"]

#: Data slots per ubatch (kernels/gather.cuh kGatherDataSlots).
DATA_SLOTS = 3
#: Threads per CTA (kernels/gather.cuh kGatherThreads).
THREADS = 512
#: Largest number of 16-byte vectors one call may move into a slot (u32 indices in the kernel).
MAX_VECTORS = 2**31 - 1
#: Largest world of a zero-copy graph call (kernels/gather.cuh kZeroCopyMaxWorld); a larger
#: world copies out.
ZERO_COPY_MAX_WORLD = 64
#: Smallest block per rank (bytes) whose captured view-form call is zero copy. Below it the
#: copy-out of the few rows costs less than waiting for the peers' credits: one H200 shared by
#: the ranks under MPS, graph, kv_gather 4.5 KiB per rank 4.75 us copying out against 5.50 us
#: zero copy (W=2), 6.97 against 7.22 (W=4); from 36 KiB per rank (q_gather T=1) on, zero copy
#: was faster at W=2 and 4.
ZERO_COPY_MIN_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True, eq=False)
class GatherPlan:
    """A validated gather call (see :mod:`dcpkit._plan`): everything its key determines.

    It holds no reference to the caller's arrays (only their addresses): a plan never keeps a
    freed array's memory alive, and a call returns the ``out`` it was given. The fields are
    read-only slots: CPython specialises the read of a slot, where a NamedTuple field is a
    descriptor call (about three times the instructions; a call reads seven fields).

    NOTE [dcpkit gather out field]: the kernel's ``out`` parameter is packed with what every
    call of the plan writes until its ubatch is captured: the caller's ``out=`` (every path
    writes that pointer), or 0 (zero copy). The hot path patches it only in an eager call after
    a capture (a workspace output buffer, by parity), and so does the general path while
    capturing; both happen only once ``_captured[ubatch]`` is True, and it never goes back to
    False, so from then on no call of the plan takes the zero-copy branch, which relies on the
    packed 0."""

    T: int
    ubatch: int
    out_ptr: int  # the caller's out= (0: none)
    grid_copy: int  # CTAs when the kernel copies out (out=, capture, after a capture)
    grid_zero_copy: int  # CTAs when the result is read from the own data slot
    params: object  # KernelParams, the ``out`` field patched per call
    out_field: object  # that field (ctypes), patched without a Python call
    slots: tuple[int, ...]  # addresses of the ubatch's data slots (data slot = epoch % 3)
    shape: tuple[int, ...]  # the result view
    strides: tuple[int, ...]
    debug_key: tuple  # what DCPKIT_DEBUG compares across ranks
    views: dict[int, object]  # result views by address (memoised, at most a handful)
    slot_views: list  # the zero-copy result view of each data slot (None: not made yet)


class GatherWorkspace(OpWorkspace):
    """Base class of :class:`~dcpkit.ops.QGather` and :class:`~dcpkit.ops.KVGather`.

    Attributes
    ----------
    launches_per_call : int
        Kernel launches per call: 1 (the epoch advance is folded into the kernel).
    transport : str
        ``"multicast"`` when the heap has a multicast address (and the variant uses it),
        ``"unicast"`` otherwise.
    vectors_per_cta : int
        16-byte vectors of one rank's block that one CTA handles per call before the grid grows
        (tuning knob: small values spread decode-size calls over more SMs). The grid never
        exceeds ``max_ctas`` (the SM count, divided among ranks sharing a GPU).
    waiter_ctas : int
        CTAs of a copy-out call that wait for the peers and share the copy-out (the others
        store, signal and exit); a zero-copy call has one. Default: the SM share divided by
        ``MAX_LIVE_KERNELS`` (8), at least 1 (NOTE [dcpkit epoch signalling], co-residency
        rule).
    THREADS : int
        Threads per CTA.
    """

    launches_per_call = 1
    vectors_per_cta = 512
    #: Threads per CTA of the gather kernels (kernels/gather.cuh kGatherThreads).
    THREADS = THREADS

    def _region_bytes(self) -> tuple[int, int]:
        """The two base slots hold ``DATA_SLOTS`` data slots of ``_data_bytes()`` (rounded up),
        back to back; the output buffers hold ``_data_bytes()`` each. Sets
        ``data_slot_bytes``."""
        nbytes = self._data_bytes()
        slot = _round_up(max(int(nbytes), 16))
        self.data_slot_bytes = slot
        return -(-DATA_SLOTS * slot // 2), nbytes

    def _compile(self, file: str, name_expr: str):
        """Compile (or fetch) the kernel on every rank; a failure anywhere closes the workspace
        and raises on every rank."""
        import cupy

        from .. import jit

        err: BaseException | None = None
        kernel = None
        try:
            with cupy.cuda.Device(self.device):
                kernel = jit.get_kernel(file, name_expr, self._kernel_options())
                self._init_fast_path({0: kernel.kernel})  # the loaded Function of this device
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            err = e
        try:
            self.comm.all_ok(f"{self.op_name}: kernel compile ({name_expr})", err)
        except BaseException:
            self.close()
            raise
        return kernel

    # ------------------------------------------------------------------ per call
    def _symmetric_graph_outputs(self) -> bool:
        """Push gathers keep their graph output buffers in the symmetric region (zero copy); the
        pull algorithm copies into them and keeps them in ordinary memory."""
        return getattr(self, "algorithm", "push") != "pull"

    def _zero_copy_graph(self, T: int) -> bool:
        """Whether a call of ``T`` tokens captured without out= has its result stored straight
        into its graph output buffer by every rank (unicast push, world within the kernel's
        table, at least ZERO_COPY_MIN_BYTES per rank). The same on every rank (config and T)."""
        return (
            self._pool_in_region
            and not self.multicast
            and self.world_size <= ZERO_COPY_MAX_WORLD
            and T * self.row_bytes >= ZERO_COPY_MIN_BYTES
        )

    def data_slot_ptr(self, ubatch: int, index: int) -> int:
        """Device address of data slot ``index`` (0, 1 or 2) of ``ubatch`` in this rank's
        copy."""
        return self.local_slot_ptr(ubatch, 0) + index * self.data_slot_bytes

    def _call_keyed(self, key, x, ubatch, out, stream, flag):
        """A call whose flat key (:func:`dcpkit._plan.pair_key`) is ``key`` (None: keyed in
        full): the closed / poisoned check, the plan (the full validation on a miss), the
        stream check (every check runs before anything is counted or launched); then
        :meth:`_empty_call` (``T == 0``), :meth:`_gather_call_general` (a capturing stream or
        ``DCPKIT_DEBUG``), or the eager hot path: the bookkeeping, the ``out`` field patched,
        one launch, the result (``out`` itself, or a memoised view of workspace memory)."""
        if self._closed or self._rec_head[0] or self._launch_failed is not None:
            self.check_open()  # raises: closed or poisoned, every call
        plans = self._plans
        plan = plans._plans.get(key)
        if plan is None:
            plan = plans.get(key, (x, out), (ubatch, flag), x, ubatch, out, flag)
        else:
            plans.hits += 1
        if stream is not None and not isinstance(stream, _cuda._STREAM_TYPES):
            self._check_stream(stream)  # raises InvalidType unless a CuPy stream
        if plan.T == 0:
            return self._empty_call(plan, out)
        # The hot path (eager, DCPKIT_DEBUG off), inline: every address it needs is in the plan.
        # The current device first (the launch path); the stream: the op's GPU's current stream
        # (CuPy's current stream of a given device asks nothing more), or the caller's, which
        # must be of the op's GPU (a stream of another GPU would fail at the launch, after the
        # call was counted).
        dev = self._get_device()
        if stream is None:
            stream = self._current_stream_fn(self.device)
        elif getattr(stream, "device_id", -1) not in (-1, self.device):
            _cuda.check_stream_device(stream, self.device, self.op_name)  # raises
        if self._debug or stream.is_capturing():
            return self._gather_call_general(plan, out, stream)
        ub = plan.ubatch
        calls = self._calls
        n = calls[ub] + 1
        calls[ub] = n  # counted: a launch that raises below leaves the workspace unusable
        # The ``out`` field already holds what this call writes, except in an eager call after
        # a capture (NOTE [dcpkit gather out field]).
        kout = 0
        if out is not None:
            grid = plan.grid_copy
        elif self._captured[ub]:  # the device parity is unknown: copy out
            kout, grid = self.output_ptr(ub, False), plan.grid_copy
            plan.out_field.value = kout
        else:  # zero copy: the result is this call's data slot
            grid = plan.grid_zero_copy
        if dev == self.device:
            try:
                self._launchers[0].launch(grid, plan.params, stream.ptr)
            except BaseException as e:
                self._launch_failed = f"{type(e).__name__}: {e}"
                raise
        else:
            self._run(0, grid, plan.params, stream)
        if out is not None:
            return out
        if kout:
            v = plan.views.get(kout)
            if v is None:
                v = plan.views[kout] = self._view(kout, plan.shape, plan.strides)
            return v
        i = n % DATA_SLOTS
        v = plan.slot_views[i]
        if v is None:
            v = plan.slot_views[i] = self._view(plan.slots[i], plan.shape, plan.strides)
        return v

    def _destination(
        self, ubatch: int, stream, debug_key: tuple, out_ptr: int, T: int
    ) -> tuple[int, int]:
        """Call bookkeeping through :meth:`begin_call` (advances the host shadow of the epoch).
        Returns ``(kernel_out, result_ptr)``: the ``out`` pointer the kernel gets (0 = zero
        copy from the slot, bit 0 set = zero copy into a graph output buffer) and the address of
        the result (``out_ptr`` when the caller gave ``out=``)."""
        _, capturing, exact = self.begin_call(ubatch, stream, debug_key, needs_output=not out_ptr)
        if out_ptr:
            return out_ptr, out_ptr
        if exact:
            return 0, self.data_slot_ptr(ubatch, self._calls[ubatch] % DATA_SLOTS)
        ptr = self.output_ptr(ubatch, capturing)
        if capturing and self._zero_copy_graph(T):
            return ptr | 1, ptr  # bit 0: the peers store into the buffer (the kernel's `out`)
        return ptr, ptr

    def _gather_call_general(self, plan: GatherPlan, out, stream):
        """A validated call (``T > 0``) through :meth:`_destination`: the debug-mode agreement,
        the capture checks and the graph output buffers."""
        kout, result = self._destination(
            plan.ubatch, stream, plan.debug_key if self._debug else (), plan.out_ptr, plan.T
        )
        plan.out_field.value = kout
        if kout & 1:
            grid = self._grid_graph_view(plan.T)
        else:
            grid = plan.grid_copy if kout else plan.grid_zero_copy
        self._run(0, grid, plan.params, stream)
        if out is not None:
            return out
        v = plan.views.get(result)
        if v is None:
            v = plan.views[result] = self._view(result, plan.shape, plan.strides)
        return v

    def _empty_call(self, plan: GatherPlan, out):
        """``T == 0``: nothing launched or counted; ``out`` or an empty view."""
        if out is not None:
            return out
        return self._view(self.data_slot_ptr(plan.ubatch, 0), plan.shape, plan.strides)

    def _gather_plan(
        self,
        T: int,
        ubatch: int,
        out_info,
        tail: tuple,
        types: tuple[str, ...],
        out_index: int,
        shape,
        strides,
        *,
        mc_arg: bool = True,
    ) -> GatherPlan:
        """The plan of a validated call: the kernel parameters are :meth:`_head_args` (without
        the multicast address when not ``mc_arg``) then ``tail``, packed once; the ``out``
        field at ``out_index`` is patched per call."""
        from .._launch import KernelParams

        params, grids, field = None, (0, 0), None
        if T > 0:  # T == 0 launches nothing
            head = self._head_args(ubatch)
            if not mc_arg:
                head = head[:-1]
            params = KernelParams(types, [int(v) for v in head + tail])
            field = params.field(out_index)
            if out_info is not None:  # every call of the plan writes the caller's out=
                field.value = out_info.ptr
            grids = (
                self._grid(self._vectors(T, True)),
                self._grid_zero_copy(self._vectors(T, False)),
            )
        return GatherPlan(
            T,
            ubatch,
            out_info.ptr if out_info is not None else 0,
            *grids,
            params,
            field,
            tuple(self.data_slot_ptr(ubatch, i) for i in range(DATA_SLOTS)),
            shape,
            strides,
            (T, str(self.dtype), ubatch),
            {},
            [None] * DATA_SLOTS,
        )

    def _check_stream(self, stream) -> None:
        """Raise InvalidType unless ``stream`` is None or a CuPy stream (one isinstance on the
        hot path)."""
        if stream is not None and not isinstance(
            stream, _cuda._STREAM_TYPES or _cuda.stream_types()
        ):
            _cuda.check_stream(stream, self.op_name)  # raises InvalidType

    def _head_args(self, ubatch: int) -> tuple:
        """Protocol parameters + (peer_data, data_slot_bytes, mc_data) of ``ubatch``: constant
        for the workspace's life, built once (pointers as Python ints: CuPy passes them as
        8-byte integers)."""
        cache = self.__dict__.setdefault("_head_args_cache", {})
        args = cache.get(ubatch)
        if args is None:
            args = self.proto_args(ubatch) + (
                int(self.peer_data_ptr(ubatch)),
                int(self.data_slot_bytes),
                int(self.mc_data_ptr(ubatch)),
            )
            cache[ubatch] = args
        return args

    def _vectors(self, T: int, copy_out: bool) -> int:
        """16-byte vectors that size the grid of a call (the op's own count)."""
        raise NotImplementedError

    def ctas_for(self, T: int, *, copy_out: bool = False, graph_view: bool = False) -> int:
        """The grid (CTA count, :attr:`THREADS` threads each) of a call with ``T`` tokens:
        zero copy (eager, never captured), ``copy_out`` (``out=``, eager after a capture), or
        ``graph_view`` (captured without ``out=``: zero copy into its graph output buffer, or
        copy-out into it)."""
        if graph_view and self._zero_copy_graph(int(T)):
            return self._grid_graph_view(int(T))
        if copy_out or graph_view:
            return self._grid(self._vectors(int(T), True))
        return self._grid_zero_copy(self._vectors(int(T), False))

    def _grid(self, vectors: int) -> int:
        return launch_config(vectors, max(1, int(self.vectors_per_cta)), self.max_ctas)

    def _grid_zero_copy(self, vectors: int) -> int:
        """The grid of a zero-copy call. Only its last CTA waits, so the others just stream their
        stores; where ranks share a GPU (all of them bound by its memory) half the SM share
        measured faster than the whole share at 16 MiB per rank (8 % at W=2, 4 % at W=4, one
        H200; docs/performance.md). With one GPU per rank the grid may take the whole share."""
        cap = self.max_ctas if self.ranks_on_gpu <= 1 else max(1, self.max_ctas // 2)
        return launch_config(vectors, max(1, int(self.vectors_per_cta)), cap)

    def _grid_graph_view(self, T: int) -> int:
        """The grid of a zero-copy graph call: at most half the SM share. Every CTA of it waits
        for the peers' credits before its stores, so it counts against the co-residency budget
        (MAX_LIVE_KERNELS kernels of waiter_ctas each, one CTA per SM in all) like
        max_ctas / 2 / waiter_ctas live kernels, not one."""
        cap = max(1, self.max_ctas // 2)
        return launch_config(self._vectors(int(T), False), max(1, int(self.vectors_per_cta)), cap)

    def _view(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...]):
        """A CuPy array over workspace memory at ``ptr`` (no copy). It keeps the workspace object
        alive, but not its memory: a view is invalid after :meth:`close`.

        Views are memoised per (address, shape, strides): the result of call ``n + 3`` of a
        ubatch may be the same Python object as that of call ``n`` (the same memory, by the
        lifetime rule), which keeps object creation off the hot path."""
        import cupy

        key = (ptr, shape, strides)
        cache = self.__dict__.setdefault("_view_cache", {})
        v = cache.get(key)
        if v is not None:
            return v
        nbytes = 0
        if all(s > 0 for s in shape):
            nbytes = sum((n - 1) * st for n, st in zip(shape, strides)) + self.dtype.itemsize
        mem = cupy.cuda.UnownedMemory(int(ptr), int(nbytes), self, int(self.device))
        v = cupy.ndarray(
            shape, dtype=self.dtype, memptr=cupy.cuda.MemoryPointer(mem, 0), strides=strides
        )
        if len(cache) > 4096:
            cache.clear()
        cache[key] = v
        return v
