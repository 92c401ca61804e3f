"""What the three NCCL ops share: the agreed argument check, the NCCL group, buffers, call
bookkeeping and the lifetime (see :mod:`dcpkit.nccl` for what each op runs)."""

from __future__ import annotations

from typing import NamedTuple

from .. import _cuda
from .._arrays import ArrayInfo, array_info, check_device, check_dtype, check_shape
from .._checks import (
    INT32_MAX,
    check_comm,
    check_multicast,
    check_positive_int,
    check_timeout_ms,
    check_ubatch,
    resolve_stream,
)
from .._lifecycle import Resource
from .._setup import collective_step, debug_enabled, guarded
from .._strided import copy_arrays, load_copy_kernels
from ..comm import Communicator
from ..errors import ClosedError, InvalidArgument, InvalidType
from ..symmetric import MAX_NBYTES, SymmetricHeap
from .group import NcclGroup, nccl_module

__all__ = ["NcclOp", "NcclGather", "CheckedArguments", "PATH_NCCL", "check_heap_type"]

#: Name of the path every NCCL op records (``DCPComm.last_path``).
PATH_NCCL = "nccl"


class CheckedArguments(NamedTuple):
    """Constructor keywords of an NCCL op, checked (:meth:`NcclOp.prepare`)."""

    cls: type  # the op class
    agreed: tuple  # what every rank must agree on
    geometry: dict  # the checked values, by attribute name


def check_heap_type(heap, op: str) -> None:
    """``heap=`` of an NCCL op (accepted for signature compatibility, unused): None or a
    :class:`~dcpkit.symmetric.SymmetricHeap`."""
    if heap is not None and not isinstance(heap, SymmetricHeap):
        raise InvalidType(
            f"{op}: heap must be None or a dcpkit.SymmetricHeap (got {type(heap).__name__})"
        )


class NcclOp(Resource):
    """What the three NCCL ops share: the NCCL group, call counters, buffers, lifetime.

    A subclass names its ``agreed_names`` and implements ``_check_geometry(world_size,
    **geometry keywords)`` (a classmethod: every check that needs no GPU and no collective,
    returning what every rank must agree on and the checked geometry with the sizes derived
    from it), ``_make_buffers()``, ``_warmup_call(T)`` and ``_free_buffers()`` (the two
    gathers take the buffer pair from :class:`NcclGather`); its constructor passes its arguments
    to :meth:`_construct`.
    """

    op_name = "op"

    @property
    def _resource_name(self) -> str:  # the name in the unclosed-resource warning
        return f"{self.op_name} (nccl)"

    _noun = "workspace"
    path = PATH_NCCL
    algorithm = ""
    multicast = False
    transport = "nccl"

    #: The geometry keywords every rank must pass equal, as a ConfigMismatch names them.
    agreed_names = ""

    # ------------------------------------------------------------------ construction
    def _construct(self, arguments: dict) -> None:
        """The constructor of every NCCL op, given all its arguments (``locals()`` of its
        ``__init__``, so that no keyword can be left out of the checks): the geometry keywords
        go to :meth:`_agree_geometry` with ``heap`` / ``multicast`` (type-checked only), then
        :meth:`_build` (collective)."""
        geometry = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
        comm, nccl_group = geometry.pop("comm"), geometry.pop("nccl_group")
        unused = {k: geometry.pop(k) for k in ("heap", "multicast") if k in geometry}
        self._agree_geometry(comm, geometry, self.agreed_names, nccl_group, **unused)
        self._build(nccl_group)

    def _build(self, nccl_group: NcclGroup | None) -> None:
        """The NCCL group, kernels, buffers and warm-up of a checked geometry (collective)."""
        self._setup_nccl(nccl_group)
        self._allocate(self._make_buffers)
        self._finish()

    def _make_buffers(self) -> None:
        """Allocate the op's device buffers with :meth:`_alloc` (run by :meth:`_allocate`)."""
        raise NotImplementedError

    def _agree_geometry(
        self,
        comm: Communicator,
        arguments: dict,
        what: str,
        nccl_group: NcclGroup | None,
        *,
        heap=None,
        multicast=None,
    ) -> None:
        """Run :meth:`_check_geometry` on ``arguments`` (the geometry keywords), then the
        ``heap`` / ``multicast`` type checks and the CuPy, NCCL, GPU and ``nccl_group`` checks,
        on every rank in one exchange: raise on every rank if any rank failed or if the
        geometries differ. Sets the checked geometry as attributes."""
        op = self.op_name
        self.comm = check_comm(comm, op)
        self.rank = comm.rank
        self.world_size = comm.world_size

        def init():
            values = self._check_arguments(comm.world_size, **arguments)
            check_heap_type(heap, op)
            check_multicast(multicast, op)
            _cuda.require_cupy()
            if nccl_group is None:
                nccl_module()  # the group this op creates needs it
                _cuda.require_device(op)
                return values
            device = _cuda.require_device(op)
            if not isinstance(nccl_group, NcclGroup):
                raise InvalidType(
                    f"{op}: nccl_group must be a dcpkit.nccl.NcclGroup "
                    f"(got {type(nccl_group).__name__})"
                )
            if nccl_group.closed:
                raise ClosedError(f"{op}: nccl_group must be open (got a closed NcclGroup)")
            if (nccl_group.device, nccl_group.comm.world_size) != (device, comm.world_size):
                raise InvalidArgument(
                    f"{op}: nccl_group must be a group on GPU {device} with world_size "
                    f"{comm.world_size} (got GPU {nccl_group.device}, world_size "
                    f"{nccl_group.comm.world_size})"
                )
            return values

        self._debug = debug_enabled()  # a per-call host collective where on: every rank or none
        comm.agree_setup(
            f"{op} (nccl)", guarded(op, init), f"geometry ({what})", {"DCPKIT_DEBUG": self._debug}
        )

    @classmethod
    def check_arguments(cls, world_size: int, **constructor_keywords) -> tuple:
        """Check constructor keywords as the constructor does, without a GPU or a collective.

        Parameters
        ----------
        world_size : int
            Size of the group the op would be built for (>= 1).
        **constructor_keywords
            The constructor's keywords; ``heap`` and ``multicast`` are type-checked only
            (unused by the NCCL ops), ``nccl_group`` is checked by the constructor.

        Returns
        -------
        tuple
            What every rank must agree on, as the constructor agrees on it.

        Raises
        ------
        InvalidArgument, InvalidType
            As the constructor, with the same messages.
        """
        return cls.prepare(world_size, **constructor_keywords).agreed

    @classmethod
    def prepare(cls, world_size: int, **constructor_keywords) -> CheckedArguments:
        """:meth:`check_arguments`, keeping the checked geometry for :meth:`from_checked`.

        For an owner that agrees on its own arguments once for several ops (DCPComm): it checks
        every op's keywords inside its one agreed exchange, then builds each op from what was
        checked, without a second check or a second exchange.
        """
        op = cls.op_name
        keywords = dict(constructor_keywords)
        check_heap_type(keywords.pop("heap", None), op)
        check_multicast(keywords.pop("multicast", None), op)
        keywords.pop("nccl_group", None)  # checked by the constructor, against the group
        W = check_positive_int(world_size, op, "world_size")
        return CheckedArguments(cls, *cls._check_geometry(W, **keywords))

    @classmethod
    def from_checked(
        cls, comm: Communicator, checked: CheckedArguments, nccl_group: NcclGroup
    ) -> NcclOp:
        """Build the op from :meth:`prepare`'s result on every rank of ``comm``, sharing the
        open ``nccl_group``. The caller guarantees what the constructor's exchange would have
        established: equal ``checked`` on every rank (agreed), and ``nccl_group`` an open group
        of ``comm`` on this rank's GPU (so NCCL and a GPU are there on every rank).

        Collective: the buffers, the warm-up and the closing barrier, as the constructor.

        Raises
        ------
        InvalidType
            ``checked`` was prepared for another class, or ``nccl_group`` is not an NcclGroup.
        InvalidArgument
            ``checked`` was prepared for another world size.
        """
        if not isinstance(checked, CheckedArguments) or checked.cls is not cls:
            raise InvalidType(
                f"{cls.op_name}: checked must come from {cls.__name__}.prepare "
                f"(got {type(checked).__name__})"
            )
        if not isinstance(nccl_group, NcclGroup):
            raise InvalidType(
                f"{cls.op_name}: nccl_group must be a dcpkit.nccl.NcclGroup "
                f"(got {type(nccl_group).__name__})"
            )
        check_comm(comm, cls.op_name)
        if checked.geometry["world_size"] != comm.world_size:
            raise InvalidArgument(
                f"{cls.op_name}: checked world_size must be comm's "
                f"{comm.world_size} (got {checked.geometry['world_size']})"
            )
        self = cls.__new__(cls)
        vars(self).update(checked.geometry)
        self.comm, self.rank = comm, comm.rank
        self._build(nccl_group)
        return self

    def _check_arguments(self, world_size: int, **geometry_keywords) -> tuple:
        """:meth:`_check_geometry`, setting the checked geometry on this op; returns what every
        rank must agree on."""
        values, geometry = self._check_geometry(world_size, **geometry_keywords)
        vars(self).update(geometry)
        return values

    def accepts_layout(self, **arrays) -> bool:
        """Always True: the NCCL ops take any strides (strided arrays are copied)."""
        return True

    @classmethod
    def _check_common(cls, world_size: int, max_tokens, num_ubatches, timeout_ms) -> dict:
        """The checks every NCCL op shares; returns the checked values by attribute name."""
        op = cls.op_name
        return dict(
            world_size=int(world_size),
            max_tokens=check_positive_int(
                max_tokens, op, "max_tokens", maximum=INT32_MAX
            ),  # an int kernel parameter
            num_ubatches=check_positive_int(num_ubatches, op, "num_ubatches"),
            timeout_ms=check_timeout_ms(timeout_ms, op),
        )

    @classmethod
    def _check_buffer_bytes(cls, num_ubatches: int, per_ubatch: int, size_arguments: str) -> None:
        """The buffers allocated at construction must stay <= 2**40 bytes."""
        U = num_ubatches
        if U * per_ubatch > MAX_NBYTES:
            raise InvalidArgument(
                f"{cls.op_name}: num_ubatches * buffer bytes per ubatch must be <= 2**40 (got "
                f"{U} * {per_ubatch} = {U * per_ubatch}): lower {size_arguments} or "
                f"num_ubatches"
            )

    def _setup_nccl(self, nccl_group: NcclGroup | None) -> None:
        """The NCCL group (shared or own), the device, counters and kernels (collective)."""
        import cupy

        self._cupy = cupy
        if nccl_group is not None:  # checked on every rank by _agree_geometry
            self.device = nccl_group.device
            self._owns_group = False
        else:
            nccl_group = NcclGroup(self.comm)  # collective, agreed
            self._owns_group = True
            self.device = nccl_group.device
        self.nccl_group = nccl_group
        self._nccl = nccl_group.nccl
        self._nccl_mod = nccl_group.nccl_mod
        U = self.num_ubatches
        self._calls = [0] * U
        self._captured = [False] * U
        collective_step(
            self.comm,
            f"{self.op_name} (nccl): kernel compile",
            self._load_kernels,
            on_failure=self._release,
        )

    def _load_kernels(self) -> None:
        """The local kernels this op launches (loaded now: a call must not compile)."""
        load_copy_kernels(self.device)

    def _allocate(self, build) -> None:
        """Run ``build()`` (buffer allocation) on every rank; a failure anywhere releases what
        was set up and raises on every rank."""
        collective_step(
            self.comm, f"{self.op_name} (nccl): buffers", build, on_failure=self._release
        )

    def _alloc(self, nbytes: int):
        """A device buffer of ``nbytes`` (at least 256) on this op's GPU."""
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            return cupy.empty(max(int(nbytes), 256), dtype=cupy.uint8)

    def _per_ubatch(self, nbytes: int) -> list:
        """One buffer of ``nbytes`` per ubatch (:meth:`_alloc`)."""
        return [self._alloc(nbytes) for _ in range(self.num_ubatches)]

    def _result_slots(self, nbytes: int) -> list:
        """Per ubatch, the three result buffers of ``nbytes`` that :meth:`_begin`'s index picks
        (0 and 1 alternate for eager calls, 2 is the graph's)."""
        return [[self._alloc(nbytes) for _ in range(3)] for _ in range(self.num_ubatches)]

    def _view(self, buf, shape: tuple[int, ...], dtype, offset: int = 0):
        """A C-contiguous typed view of ``buf`` (a uint8 CuPy array) at byte ``offset``."""
        return self._cupy.ndarray(tuple(shape), dtype, memptr=buf.data + int(offset))

    def _finish(self) -> None:
        """Warm-up (compiles, NCCL connections for the sizes used), then a barrier."""
        cupy = self._cupy

        def warm_up():
            with cupy.cuda.Device(self.device):
                for T in sorted({1, self.max_tokens}):
                    self._warmup_call(T)
                cupy.cuda.runtime.deviceSynchronize()

        collective_step(
            self.comm, f"{self.op_name} (nccl): warm-up", warm_up, on_failure=self._release
        )
        self._calls = [0] * self.num_ubatches
        self._closed = False
        self.comm.barrier()

    # ------------------------------------------------------------------ per call
    def check_open(self) -> None:
        self._check_open(self.op_name)

    def check_ubatch(self, ubatch) -> int:
        """``ubatch`` as an int in ``[0, num_ubatches)``."""
        return check_ubatch(ubatch, self.num_ubatches, self.op_name)

    def get_stream(self, stream):
        """``stream``, or the current CuPy stream for None; :class:`InvalidType` unless a CuPy
        stream."""
        return resolve_stream(stream, self.op_name, self.device)

    def _begin(self, ubatch: int, T: int, stream, debug_key: tuple) -> tuple[int, bool]:
        """Bookkeeping after validation, before the first launch. Returns ``(buffer index,
        capturing)``: 0/1 alternate for eager calls, 2 is the ubatch's graph buffer."""
        if self._debug:
            self.comm.agree(
                f"{self.op_name} (nccl): call arguments (op, T, dtype, ubatch, ...)",
                (self.op_name,) + tuple(debug_key),
            )
        capturing = bool(stream.is_capturing())
        if capturing and T > self.max_tokens:
            raise InvalidArgument(
                f"{self.op_name}: T must be <= max_tokens {self.max_tokens} while a CUDA graph "
                f"is being captured (got {T}): beyond max_tokens the NCCL path allocates its "
                f"buffers per call"
            )
        if capturing:
            self._captured[ubatch] = True
        self._calls[ubatch] += 1
        return (2 if capturing else self._calls[ubatch] & 1), capturing

    def _scratch(self, per_ubatch: list, ubatch: int, T: int, nbytes: int, stream):
        """The preallocated buffer of ``ubatch`` when ``T <= max_tokens``, else a fresh one from
        CuPy's pool on ``stream`` (eager calls only: :meth:`_begin` refused capture)."""
        if T <= self.max_tokens:
            return per_ubatch[ubatch]
        cupy = self._cupy
        with cupy.cuda.Device(self.device), stream:
            return cupy.empty(max(int(nbytes), 256), dtype=cupy.uint8)

    def _out_buffer(self, outs: list, ubatch: int, index: int, T: int, nbytes: int, stream):
        if T <= self.max_tokens:
            return outs[ubatch][index]
        return self._scratch([], ubatch, T, nbytes, stream)

    def _copy(self, dst: ArrayInfo, src: ArrayInfo, stream) -> None:
        copy_arrays(dst, src, stream)

    def _info(self, arr, name: str) -> ArrayInfo:
        return array_info(arr, self.op_name, name)

    def _checked(
        self, arr, name: str, shape: tuple, dims: str, dtypes=None, *, dtype_first: bool = False
    ) -> ArrayInfo:
        """``arr`` described and checked: ``shape`` (None: any extent), a dtype of ``dtypes``
        (default: the op's), on the op's GPU; the shape or (``dtype_first``) the dtype first."""
        op, info = self.op_name, self._info(arr, name)
        if dtype_first:
            check_dtype(info, dtypes or (self.dtype,), op, name)
        check_shape(info, shape, dims, op, name)
        check_dtype(info, dtypes or (self.dtype,), op, name)
        check_device(info, self.device, op, name)
        return info

    def synchronize(self, stream=None) -> None:
        """Wait for ``stream`` (default: the current CuPy stream), then raise if NCCL reported
        an asynchronous error. Stream: synchronises the host with ``stream``."""
        self.check_open()
        self.get_stream(stream).synchronize()
        self.nccl_group.check_async_error()

    @property
    def poisoned(self) -> bool:
        """Always False: NCCL ops have no deadline (see the module docstring)."""
        return False

    def _set_epoch(self, value: int) -> None:
        """Test hook of the direct ops; here it only sets the host call counters."""
        self.check_open()
        self._calls = [int(value)] * self.num_ubatches

    # ------------------------------------------------------------------ teardown
    def _release(self) -> None:
        self._closed = True
        if getattr(self, "_owns_group", False) and getattr(self, "nccl_group", None) is not None:
            self.nccl_group.close()
        self.nccl_group = None
        self._nccl = None
        self._free_buffers()

    def _free_buffers(self) -> None:  # overridden
        pass

    def close(self) -> None:
        """Wait for the device and free the buffers; close the NCCL group if this op created it
        (collective, idempotent). Later calls raise :class:`ClosedError`."""
        super().close()

    def _close(self) -> None:
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
        self._release()


class NcclGather(NcclOp):
    """The buffers the two NCCL gathers share: per ubatch, a send buffer of ``max_tokens`` rows
    of ``row_bytes`` and the three result slots (:meth:`NcclOp._result_slots`) of
    ``_result_bytes``, both set by the subclass's ``_check_geometry``."""

    def _make_buffers(self) -> None:
        self._send = self._per_ubatch(self.max_tokens * self.row_bytes)
        self._outs = self._result_slots(self._result_bytes)

    def _free_buffers(self) -> None:
        self._send = self._outs = None
